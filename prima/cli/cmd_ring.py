"""`prima ring`: local rings and the state of running daemons.

prima ring up -n 3            start 3 primad on 127.0.0.1 (advertised over mDNS there) until Ctrl-C
prima ring status --nodes h:p,h:p   what each daemon holds (plan, windows, residency)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading

from prima.cli.arg_types import positive_int
from prima.cli.engine_options import parse_nodes
from prima.cluster.local_ring import LocalRing
from prima.model.registry import DEFAULT_MODEL
from prima.net.client import NodeClient


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ring", help="start a local ring of primad daemons, or inspect running ones")
    rs = p.add_subparsers(dest="ring_command", metavar="ACTION", required=True)
    up = rs.add_parser("up", help="start N primad on 127.0.0.1 and keep them running until Ctrl-C")
    up.add_argument("-n", "--nodes", type=positive_int, default=3, help="number of daemons (default 3)")
    up.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    up.add_argument("-t", "--threads", type=positive_int, default=None, help="compute threads per daemon")
    up.add_argument("--mem-budget", default=None, help="--mem-budget for every daemon (e.g. 200M)")
    up.add_argument("--json", action="store_true", help="print the nodes as one JSON line")
    up.set_defaults(func=ring_up)
    st = rs.add_parser("status", help="print what each daemon reports (Info RPC)")
    st.add_argument("--nodes", required=True, metavar="HOST:PORT,...", help="daemons to ask")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=ring_status)


def ring_up(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    budgets = [args.mem_budget] * args.nodes if args.mem_budget else None
    with LocalRing.start(
        args.nodes, args.model, threads=args.threads, mem_budgets=budgets, mdns=True
    ) as ring:
        if args.json:
            print(
                json.dumps([{"node_id": n.node_id, "address": n.address, "pid": n.pid} for n in ring.nodes])
            )
        else:
            for n in ring.nodes:
                print(f"{n.node_id}  {n.address}  pid {n.pid}")
            print(
                "use with: prima run -p '...' (found over mDNS on 127.0.0.1) or "
                f"prima run --nodes {','.join(ring.addresses)} -p '...'   (Ctrl-C stops the ring)"
            )
        (stop or threading.Event()).wait()
    return 0


def ring_status(args: argparse.Namespace) -> int:
    rows = []
    for address in parse_nodes(args.nodes):
        client = NodeClient(address)
        try:
            rows.append((address, client.info()))
        finally:
            client.close()
    if args.json:
        print(json.dumps([{"address": a, **dataclasses.asdict(s)} for a, s in rows]))
        return 0
    for address, s in rows:
        wins = " ".join(str(w) for w in s.windows) or "-"
        res = s.residency
        mem = f", {res.resident_bytes / 2**20:.1f}/{res.owned_bytes / 2**20:.1f} MiB resident" if res else ""
        print(f"{s.node_id} @ {address}: {s.status}, epoch {s.plan_epoch}, windows {wins}{mem}")
    return 0
