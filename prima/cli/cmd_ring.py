"""`prima ring`: local rings and the state of running daemons.

prima ring up -n 3            start 3 primad on 127.0.0.1 (advertised over mDNS there) until Ctrl-C
prima ring up -n 3 --detach   the same in the background; `prima ring down` stops them
prima ring status --nodes h:p,h:p   what each daemon holds (plan, windows, residency), in ring order
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from prima import paths
from prima.cli.arg_types import node_addresses, parse_budget, positive_int
from prima.cli.engine_options import add_discovery_args, discover_addresses
from prima.coordinator.local_ring import LocalRing
from prima.errors import InputError, NodeError
from prima.model.registry import DEFAULT_MODEL
from prima.net import credentials
from prima.net.client import NodeClient
from prima.net.credentials import ClusterCA
from prima.net.node_status import NodeStatus
from prima.plan import windows_text

log = logging.getLogger("prima.cli")

STOP_TIMEOUT_S = 15.0  # a daemon sends its mDNS goodbye and stops its server within this


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
    up.add_argument(
        "-d",
        "--detach",
        action="store_true",
        help="leave the daemons running in the background (stop: ring down)",
    )
    up.set_defaults(func=ring_up)
    down = rs.add_parser("down", help="stop the daemons `prima ring up --detach` started")
    down.set_defaults(func=ring_down)
    st = rs.add_parser("status", help="print what each daemon reports (Info RPC)")
    st.add_argument(
        "--nodes",
        type=node_addresses,
        default=None,
        metavar="HOST:PORT,...",
        help="daemons to ask (default: those found over mDNS)",
    )
    add_discovery_args(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=ring_status)


def ring_up(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    if args.mem_budget:
        parse_budget(args.mem_budget)  # refused here, in primad's words, before any daemon starts
    budgets = [args.mem_budget] * args.nodes if args.mem_budget else None
    if args.detach:
        return _ring_up_detached(args, budgets)
    with LocalRing.start(
        args.nodes, args.model, threads=args.threads, mem_budgets=budgets, mdns=True, **ring_credentials()
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
    """Every daemon's Info, in ring order (the head first, marked), and the ones that did not
    answer said so; exit 1 if a daemon named with --nodes did not answer."""
    addresses = args.nodes or discover_addresses(args, None)
    if not addresses:
        raise InputError(
            f"no primad answered over mDNS within {args.discover_timeout:g} s; start one (prima ring up) "
            "or name them with --nodes host:port,..."
        )
    answers: list[tuple[str, NodeStatus]] = []
    silent: list[tuple[str, str]] = []
    for address in addresses:
        client = NodeClient(address)
        try:
            answers.append((address, client.info()))
        except NodeError as exc:
            silent.append((address, str(exc)))
        finally:
            client.close()
    ordered = ring_order(answers)
    head = ordered[0][0] if ordered and _holds_last_layer(ordered[0][1]) else None
    if args.json:
        rows: list[dict[str, Any]] = [
            {"address": a, "head": a == head, **dataclasses.asdict(s)} for a, s in ordered
        ]
        rows += [{"address": a, "error": why} for a, why in silent]
        print(json.dumps(rows))
    else:
        for address, s in ordered:
            _print_status(address, s, is_head=address == head)
        for address, why in silent:
            print(f"{address}: not answering: {why}")
    return 1 if silent and args.nodes else 0


def ring_order(answers: list[tuple[str, NodeStatus]]) -> list[tuple[str, NodeStatus]]:
    """`answers` as the ring runs: of the nodes under the newest plan, the head (which computes
    the last layers: prima.plan.Plan.hops) first, then the rest by their first layer; then
    nodes under an older plan or none, by address."""
    newest = max((s.plan_epoch for _, s in answers), default=0)

    def key(item: tuple[str, NodeStatus]) -> tuple[int, int, str]:
        address, s = item
        starts = [w.start for w in s.windows if w.n_layers]
        if s.plan_epoch != newest or not starts:
            return (2, 0, address)
        return (0 if _holds_last_layer(s) else 1, min(starts), address)

    return sorted(answers, key=key)


def _holds_last_layer(s: NodeStatus) -> bool:
    return any(w.end == s.n_layers and w.n_layers for w in s.windows)


def _print_status(address: str, s: NodeStatus, *, is_head: bool) -> None:
    wins = windows_text(s.windows)
    res = s.residency
    mem = f", {res.resident_bytes / 2**20:.1f}/{res.owned_bytes / 2**20:.1f} MiB resident" if res else ""
    link = (
        f", activation link on port {s.link_port}"
        if s.link_port
        else ", no activation link (relays over gRPC)"
    )
    role = " (head)" if is_head else ""
    print(f"{s.node_id} @ {address}{role}: {s.status}, epoch {s.plan_epoch}, windows {wins}{mem}{link}")
    if res and res.budget_bytes and res.budget_bytes < res.owned_bytes:
        print(
            f"  streaming: budget {res.budget_bytes / 2**20:.0f} MiB, {res.pinned_layers} layers pinned; read "
            f"{res.bytes_read / 2**20:.0f} MiB in {res.read_ms:.0f} ms, computed {res.compute_ms:.0f} ms, "
            f"waited {res.wait_ms:.0f} ms for reads"
        )


def ring_credentials() -> dict[str, Any]:
    """How a ring other processes will use is secured: with certificates from this device's
    cluster CA if it holds one (any member may then call it), else plaintext on loopback, which
    a coordinator without a cluster identity on this machine talks to (docs/security.md)."""
    try:
        return {"ca": ClusterCA.load(credentials.cluster_dir())}
    except InputError:
        return {"plaintext": True}


def _ring_up_detached(args: argparse.Namespace, budgets: list[str] | None) -> int:
    state = paths.ring_state_file()
    running = [n for n in _recorded_nodes(state) if _is_primad(n["pid"])]
    if running:
        raise InputError(
            f"a detached ring is already up ({', '.join(n['node_id'] for n in running)}); "
            "stop it with `prima ring down` first"
        )
    logs = state.parent / "ring-logs"
    ring = LocalRing.start(
        args.nodes,
        args.model,
        threads=args.threads,
        mem_budgets=budgets,
        mdns=True,
        detach=True,
        log_dir=logs,
        **ring_credentials(),
    )
    nodes = [{"node_id": n.node_id, "address": n.address, "pid": n.pid} for n in ring.nodes]
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"nodes": nodes}) + "\n")
    if args.json:
        print(json.dumps(nodes))
    else:
        for n in ring.nodes:
            print(f"{n.node_id}  {n.address}  pid {n.pid}")
        print(f"running in the background (logs in {logs}); stop with: prima ring down")
    return 0


def ring_down(args: argparse.Namespace) -> int:
    """SIGTERM each daemon of the detached ring (only if that pid is still a primad), wait for
    them to withdraw their adverts and exit, then forget the ring."""
    del args
    state = paths.ring_state_file()
    nodes = _recorded_nodes(state)
    if not nodes:
        raise InputError(f"no detached ring is recorded in {state}; start one with `prima ring up --detach`")
    live = [n for n in nodes if _is_primad(n["pid"])]
    for n in live:
        os.kill(n["pid"], signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(_is_primad(n["pid"]) for n in live) and time.monotonic() < deadline:
        time.sleep(0.1)
    stubborn = [n for n in live if _is_primad(n["pid"])]
    for n in stubborn:
        os.kill(n["pid"], signal.SIGKILL)
    state.unlink()
    print(f"stopped {len(live)} daemon(s)" + (f" ({len(stubborn)} killed)" if stubborn else ""))
    return 0


def _recorded_nodes(state: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(state.read_text())["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _is_primad(pid: int) -> bool:
    """True while `pid` is a live primad (not a zombie, not a recycled pid of another program)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "prima.cli.primad" in " ".join(proc.cmdline())
    except psutil.Error:
        return False
