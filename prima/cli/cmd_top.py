"""`prima top`: what a running `prima serve` says about its cluster (GET /v1/cluster), in the
terminal: the plan, each hop of a forward pass with its predicted and measured ms, each node
with its windows, memory and times, dropped devices and recent failures. `--watch` redraws."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from prima.api.server import API_KEY_ENV
from prima.cli.arg_types import positive_int
from prima.errors import PrimaError

DEFAULT_URL = "http://127.0.0.1:8080"
READ_TIMEOUT_S = 10.0
MAX_FAILURES_SHOWN = 5
CLEAR = "\x1b[H\x1b[2J"


class ClusterReadError(PrimaError):
    """The server could not be read: not running, not prima, or the key was refused."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="show the cluster a running `prima serve` runs on")
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help=f"the server's API key (default: ${API_KEY_ENV})")
    p.add_argument("--json", action="store_true", help="print the JSON the server answered")
    p.add_argument(
        "--watch", type=float, default=0.0, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C"
    )
    p.add_argument(
        "--count", type=positive_int, default=None, help="with --watch: stop after this many readings"
    )
    p.set_defaults(func=top)


def top(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.watch < 0:
        raise ClusterReadError(f"--watch must be >= 0 seconds, got {args.watch}")
    readings = 0
    while True:
        view = read_cluster(args.url, key)
        text = json.dumps(view) if args.json else format_cluster(view)
        if args.watch and sys.stdout.isatty():
            sys.stdout.write(CLEAR)
        print(text, flush=True)
        readings += 1
        if not args.watch or (args.count is not None and readings >= args.count):
            return 0
        time.sleep(args.watch)


def read_cluster(url: str, api_key: str | None, timeout_s: float = READ_TIMEOUT_S) -> dict[str, Any]:
    """GET {url}/v1/cluster as JSON; ClusterReadError saying what to do if it cannot be read."""
    endpoint = url.rstrip("/") + "/v1/cluster"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(endpoint, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise ClusterReadError(
                f"{url} needs an API key: pass --api-key or set ${API_KEY_ENV}"
                if not api_key
                else f"{url} refused the API key; pass the one `prima serve` was started with"
            ) from None
        raise ClusterReadError(f"{endpoint} answered {exc.code} {exc.reason}; is it a prima serve?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ClusterReadError(
            f"cannot reach {url} ({reason}); start `prima serve` or pass its address with --url"
        ) from None
    try:
        view = json.loads(body)
    except ValueError:
        raise ClusterReadError(f"{endpoint} did not answer JSON; is it a prima serve?") from None
    if not isinstance(view, dict) or "nodes" not in view or "hops" not in view:
        raise ClusterReadError(f"{endpoint} did not answer a cluster view; is it a prima serve?")
    return view


def format_cluster(view: Mapping[str, Any]) -> str:
    """The view as lines of text: summary, hops, nodes, dropped devices, failures."""
    lines = [_summary(view)]
    if view["hops"]:
        lines += ["", "hops (one forward pass)", *_table(_hop_rows(view["hops"]))]
    if view["nodes"]:
        lines += ["", "nodes", *_table(_node_rows(view["nodes"]))]
        lines += [f"  {n['node_id']}: {n['error']}" for n in view["nodes"] if n.get("error")]
    if view.get("dropped"):
        lines += ["", "left out of the plan", *(f"  {d['node_id']}: {d['reason']}" for d in view["dropped"])]
    failures = view.get("failures") or []
    if failures:
        lines += ["", f"failures (newest {min(len(failures), MAX_FAILURES_SHOWN)} of {len(failures)})"]
        for f in reversed(failures[-MAX_FAILURES_SHOWN:]):
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(f['unix_s']))} {f['message']}")
    return "\n".join(lines)


def _summary(view: Mapping[str, Any]) -> str:
    m = view["measured"]
    where = {"local": "this device", "ring": f"a ring of {len(view['nodes'])}", "none": "no cluster view"}
    parts = [f"{view['model']} on {where.get(view['mode'], view['mode'])}"]
    if view["mode"] != "none":
        parts.append(f"{view['n_layers']} layers, {view['rounds']} round(s), plan epoch {view['plan_epoch']}")
    parts.append(f"predicted {_ms(view['predicted_ms_per_token'])}/token")
    parts.append(f"measured {_ms(m['ms_per_token'])}/token over {m['requests']} request(s)")
    return " · ".join(parts)


def _hop_rows(hops: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = [["#", "node", "round", "layers", "predicted", "compute", "send", "steps"]]
    for i, h in enumerate(hops):
        rows.append(
            [
                str(i),
                h["node_id"],
                str(h["round"] + 1),
                _window(h["window"]),
                _ms(h["predicted_ms"]),
                _ms(h.get("compute_ms")),
                _ms(h.get("relay_ms")),
                str(h.get("measured_steps", 0)),
            ]
        )
    return rows


def _node_rows(nodes: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = [["node", "role", "status", "windows", "resident/owned", "budget", "sessions", "ms/token"]]
    for n in nodes:
        r = n.get("residency")
        resident = f"{_mib(r['resident_bytes'])}/{_mib(r['owned_bytes'])}" if r else "–"
        budget = (_mib(r["budget_bytes"]) if r["budget_bytes"] else "no limit") if r else "–"
        rows.append(
            [
                n["node_id"],
                n["role"],
                n["status"],
                " ".join(_window(w) for w in n["windows"]),
                resident,
                budget,
                str(n["sessions"]),
                _ms(n.get("compute_ms_per_token")),
            ]
        )
    return rows


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _ms(t: float | None) -> str:
    return "–" if t is None else f"{t:.2f} ms" if t < 10 else f"{t:.1f} ms"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _window(w: Sequence[int]) -> str:
    return f"[{w[0]},{w[1]})"
