"""`primad`: the daemon on each device. It maps the model file, serves prima.v1 on host:port and
waits for a plan. With --port 0 it picks a free port; either way it prints one machine-readable
line when it is ready to serve:

    PRIMAD_READY {"node_id": "...", "address": "127.0.0.1:40123", "pid": 1234, ...}

Unless --no-mdns, it advertises itself over mDNS (_prima._tcp.local.) so `prima run`, `prima plan`
and `prima nodes` find it without --nodes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

# First prima import: hashing and thread pools set up before the rest loads (prima.startup).
import prima.startup  # noqa: F401
from prima.backends.modes import cpu_mode
from prima.cli.arg_types import (
    layer_window,
    non_negative_int,
    parse_budget,
    parse_disk_budget,
    positive_float,
    positive_int,
)
from prima.cli.progress import StepBar, stage
from prima.cli.stop_signals import StopSignals, add_shutdown_timeout_arg
from prima.daemon.drain import drain
from prima.daemon.fetch_source import DEFAULT_FETCH_WAIT_S, fetch_header
from prima.daemon.kept_sessions import DEFAULT_IDLE_S
from prima.daemon.runtime import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_RING_TIMEOUT_S, NodeRuntime
from prima.engine.ahead_of_time import compile_ahead
from prima.engine.compute import open_compute
from prima.errors import InputError, NodeError, PrimaError
from prima.model.registry import DEFAULT_MODEL, KNOWN_MODELS, model_path, resolve_model
from prima.model.sparse import SparseFile
from prima.net import credentials, invite
from prima.net.discovery import INTERFACES_ENV, Advertiser
from prima.net.limits import DaemonLimits, check_address
from prima.net.link_server import LinkServer
from prima.net.node_adverts import NodeAdvert
from prima.net.revocation import REVOKED_FILE, RevocationList
from prima.net.server import start_server

log = logging.getLogger("prima.cli")

READY_PREFIX = "PRIMAD_READY "
FETCH_FROM_MDNS = "mdns"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="primad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_serving_args(p)
    _add_compute_args(p)
    _add_bounds_args(p)
    _add_cluster_args(p)
    add_shutdown_timeout_arg(p, "the sessions open (the ring's generations in flight)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    return p


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """Where it listens, its model file (whole, or fetched) and its name."""
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for a LAN)"
    )
    p.add_argument(
        "--port", type=int, default=7600, help="port to listen on; 0 picks a free one (default 7600)"
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    p.add_argument(
        "--fetch-from",
        default=None,
        metavar="HOST:PORT",
        help="a primad holding the whole model, or `mdns` for one advertising that it does: with no "
        "(or a partial) file at --model, fetch from it the header now and, when a plan arrives, only "
        "the bytes of this node's windows, into a sparse file at --model (a path, or a model name's "
        "place in the cache)",
    )
    p.add_argument(
        "--fetch-wait",
        type=float,
        default=DEFAULT_FETCH_WAIT_S,
        metavar="SECONDS",
        help="how long --fetch-from waits for a source that is not up yet (still starting, or not "
        f"advertised yet), with a progress line (default {DEFAULT_FETCH_WAIT_S:g})",
    )
    p.add_argument(
        "--disk-budget",
        default="0",
        metavar="SIZE",
        help="most of the model file this node may hold, such as 20G, when it fetches its layers "
        "(--fetch-from); Halda plans within it and a plan past it is refused (default 0: no cap)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH_OR_NAME",
        help="a small GGUF with the model's vocabulary to draft tokens with when this node is a ring's "
        "head and a generation asks for `--draft model` (speculative decoding; it runs on the CPU)",
    )
    p.add_argument("--name", default=None, help="node id in plans (default: hostname:port)")


def _add_compute_args(p: argparse.ArgumentParser) -> None:
    """How it computes: memory, threads, backend, numerics, batches."""
    p.add_argument(
        "--mem-budget",
        default="auto",
        help="bytes of layer weights to keep resident: auto (default: what this device's memory "
        "cgroup or RAM leaves, measured when a plan arrives), a size such as 800M, or 0 for no limit",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=positive_int,
        default=None,
        help="compute threads at most (default: all cores; decode runs fewer while other processes keep cores busy)",
    )
    p.add_argument(
        "--backend",
        default="cpu",
        help="compute backend: cpu (default), or acl (an Ascend NPU for a plan's accel_layers, the "
        "rest on the CPU; docs/orangepi.md)",
    )
    p.add_argument(
        "--npu-ctx",
        type=positive_int,
        default=None,
        metavar="N",
        help="acl: KV slots the NPU windows are compiled for, the longest session they serve "
        "(default 512; as given to `prima npu compile --npu-ctx`)",
    )
    p.add_argument(
        "--npu-window",
        action="append",
        default=[],
        metavar="START-END",
        help="acl: layers [START, END) a plan may give this node's NPU, compiled (or found in the "
        "acl cache) before it serves; repeatable (default: the whole model as one window). A plan "
        "naming another NPU window is refused: ATC never runs inside a request",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="float32 activations in every matmul (llama.cpp's f32 numerics; slower than the int8 default)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="largest micro-batch accepted, in tokens",
    )
    p.add_argument(
        "--ring-timeout",
        type=float,
        default=DEFAULT_RING_TIMEOUT_S,
        help="seconds the head waits for activations from a ring whose nodes all answer its probes; a hung "
        f"or vanished node is named within seconds (default {DEFAULT_RING_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--keep-sessions",
        type=non_negative_int,
        default=0,
        help="as the ring's head, keep up to N ring sessions open after their generation, so a request "
        "that continues one (a chat's next turn) sends only its new tokens round the ring; each holds "
        "KV memory on every node (default 0: close each when it ends)",
    )
    p.add_argument(
        "--session-idle",
        type=positive_float,
        default=DEFAULT_IDLE_S,
        help=f"seconds a kept session may stay unused before it is closed (default {DEFAULT_IDLE_S:.0f})",
    )


def _add_bounds_args(p: argparse.ArgumentParser) -> None:
    """What it advertises and reports, and how much work it holds at once."""
    p.add_argument(
        "--no-mdns", action="store_true", help="do not advertise over mDNS (coordinators then need --nodes)"
    )
    p.add_argument(
        "--mdns-interface",
        action="append",
        metavar="IP",
        help=f"this device's address to advertise on; repeat for several (default: ${INTERFACES_ENV}, "
        "else all interfaces)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on host:PORT/metrics (0 picks a free port; default: off)",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure this device for the scheduler at start, replacing the cached profile",
    )
    p.add_argument(
        "--max-sessions",
        type=positive_int,
        default=DaemonLimits.max_sessions,
        help=f"sessions held at once (default {DaemonLimits.max_sessions}); their KV caches together "
        "may take at most --max-kv-mib",
    )
    p.add_argument(
        "--max-generates",
        type=positive_int,
        default=DaemonLimits.max_generates_per_caller,
        help="Generate calls one caller (coordinator) may run at once on this daemon as head (default "
        f"{DaemonLimits.max_generates_per_caller}); raise it for `prima serve --parallel` above that",
    )
    p.add_argument(
        "--max-kv-mib",
        type=positive_int,
        default=None,
        help="MiB the sessions' KV caches may take together (default: a quarter of this device's RAM)",
    )


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Who may call it, and how peers reach its activation link."""
    p.add_argument(
        "--cluster-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"directory holding this device's {credentials.IDENTITY_FILE} (default: "
        f"${credentials.CLUSTER_DIR_ENV}, else ~/.config/prima/cluster); see docs/security.md",
    )
    p.add_argument(
        "--join",
        metavar="HOST:PORT/CODE",
        default=None,
        help="join the cluster first with this invite (`prima cluster invite NAME` on the CA device "
        "prints it); ignored once this device has an identity",
    )
    p.add_argument(
        "--revocation-list",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"certificates this daemon refuses, written by `prima cluster revoke` (default: {REVOKED_FILE} "
        "in the cluster directory); re-read when it changes",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext gRPC to anyone who can reach the port, when this device has no cluster "
        "identity (only on a network you trust entirely)",
    )
    p.add_argument(
        "--link-port",
        type=_link_port,
        default="0",
        metavar="PORT|off",
        help="port of the activation link, the TLS socket peers relay activations to (default 0: a free "
        "port, which Info tells peers; fix one to open it in a firewall; 'off' relays over gRPC, "
        "~0.5 ms more per hop); see docs/ring.md",
    )


def _link_port(text: str) -> int | None:
    """--link-port: a port (0: any free one), or None for 'off'."""
    if text == "off":
        return None
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535) or 'off'")
    return int(text)


def daemon_limits(args: argparse.Namespace) -> DaemonLimits:
    """The daemon's bounds: --max-sessions, and KV caches within --max-kv-mib (default a quarter
    of the device's RAM)."""
    import psutil

    kv_bytes = args.max_kv_mib << 20 if args.max_kv_mib else psutil.virtual_memory().total // 4
    return DaemonLimits(
        max_sessions=args.max_sessions, max_kv_bytes=kv_bytes, max_generates_per_caller=args.max_generates
    )


def load_node_identity(args: argparse.Namespace) -> credentials.Identity | None:
    """This daemon's cluster identity, or None to serve plaintext: allowed on loopback (only this
    machine can call) or with --insecure; anywhere else a daemon without credentials refuses to
    start. With an identity, the node id is the one its certificate names."""
    identity = credentials.load_identity(args.cluster_dir)
    if identity is None and args.join:
        identity = invite.join(invite.Invite.parse(args.join))
        where = args.cluster_dir or credentials.cluster_dir()
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        credentials.write_private(where / credentials.IDENTITY_FILE, identity.to_pem())
        log.info("joined the cluster as %s (%s)", identity.name, where / credentials.IDENTITY_FILE)
    if identity is None:
        if args.insecure:
            log.warning("no cluster identity: serving plaintext gRPC on %s (--insecure)", args.host)
        elif not credentials.is_loopback(args.host):
            where = args.cluster_dir or credentials.cluster_dir()
            raise InputError(
                f"no cluster identity in {where}, so primad will not listen on {args.host}: on the device "
                "that ran `prima cluster init`, run `prima cluster invite NAME` and start primad here with "
                "--join and what it prints (or `prima cluster issue NAME` and copy the file it writes "
                f"to {where}/{credentials.IDENTITY_FILE}; docs/security.md); or --insecure on a "
                "network you trust"
            )
        return None
    if identity.role != credentials.ROLE_NODE:
        raise InputError(
            f"this device's identity ({identity.name}) is a {identity.role}'s, which may call daemons "
            "but not serve as one; on the CA device run `prima cluster issue NAME` (a node identity) "
            "and join with it"
        )
    if args.name is not None and args.name != identity.name:
        raise InputError(
            f"--name {args.name} differs from the node id in this device's certificate ({identity.name}); "
            "drop --name, or issue a certificate for that name"
        )
    args.name = identity.name
    return identity


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return serve(args)
    except PrimaError as exc:
        print(f"primad: error: {exc}", file=sys.stderr)
        return 1


def serve(args: argparse.Namespace) -> int:
    budget = parse_budget(args.mem_budget)
    disk_budget = parse_disk_budget(args.disk_budget)
    identity = load_node_identity(args)
    runtime = open_runtime(args, identity, budget, disk_budget)
    bounds = runtime.bounds
    loaded = runtime.loaded
    revoked = None
    if identity is not None:
        where = args.cluster_dir or credentials.cluster_dir()
        revoked = RevocationList(args.revocation_list or where / REVOKED_FILE, identity.roots_pem)
    server, port = start_server(
        runtime, args.host, args.port, identity=identity, limits=bounds, revoked=revoked
    )
    link = open_link_server(runtime, args, identity, bounds, revoked)
    metrics_port = _serve_metrics(runtime, args.host, args.metrics_port)
    if args.name is None:
        runtime.node_id = f"{socket.gethostname()}:{port}"
    stop = StopSignals()
    if args.reprofile:
        runtime.profile(refresh=True)
    with ExitStack() as stack:
        if not args.no_mdns:
            advert = NodeAdvert(
                node_id=runtime.node_id,
                host=args.host,
                port=port,
                model_fingerprint=runtime.fingerprint,
                model_name=loaded.name,
                holds_full_file=runtime.store.complete,
            )
            try:
                stack.enter_context(Advertiser(advert, interfaces=args.mdns_interface))
            except NodeError as exc:
                log.warning("%s; serving without mDNS", exc)
        _announce_ready(runtime, args.host, port, budget, metrics_port, tls=identity is not None)
        name = stop.wait()
        in_flight = len(runtime.stop_taking_work())
        stage(
            f"{name}: stopping: {in_flight} session(s) in flight, finishing them within "
            f"{args.shutdown_timeout:g} s (--shutdown-timeout); new sessions are refused",
            prog="primad",
        )
        # Leaving the stack sends the mDNS goodbye; the server answers on while sessions finish.
    report = drain(runtime, args.shutdown_timeout, stop.now)
    stage(f"stopped: {report.finished} session(s) finished, {report.cut} cut", prog="primad")
    if link is not None:
        link.close()
    server.stop(grace=2.0).wait(5.0)
    runtime.shutdown()
    return 0


def open_runtime(
    args: argparse.Namespace, identity: credentials.Identity | None, budget: int | None, disk_budget: int
) -> NodeRuntime:
    """The daemon's state over its model, ready to compute: the file fetched first with
    --fetch-from, then compiled, tuned and mapped (prima.engine.compute); with --backend acl its
    NPU windows compiled before it serves (prima.engine.ahead_of_time)."""
    if args.npu_window and args.backend != "acl":
        raise InputError("--npu-window compiles windows for the NPU: add --backend acl, or drop it")
    store = fetch_model(args, identity) if args.fetch_from else None
    path = store.path if store else resolve_model(args.model)
    # Compiled before the ready line, so a coordinator's calls never wait on a compile; the file
    # is mapped and the model checked, and a node validates its layers only when a plan names
    # them. A node still fetching its file cannot measure it to tune its threads.
    compute = open_compute(
        path,
        backend=args.backend,
        threads=args.threads,
        mode=cpu_mode(args.exact),
        layers=range(0),
        npu_ctx=args.npu_ctx,
        tune=store is None,
        draft_model=args.draft_model,
        on_stage=lambda msg: stage(msg, prog="primad"),
        steps=StepBar,
    )
    if args.backend == "acl":
        n_layers = compute.loaded.model.config.n_layers
        windows = [layer_window(w, n_layers, "--npu-window") for w in args.npu_window] or [range(n_layers)]
        compile_ahead(compute.loaded, windows, lambda msg: stage(msg, prog="primad"))
    return NodeRuntime(
        compute.loaded,
        args.name or "pending",
        budget_bytes=budget,
        max_batch_tokens=args.max_batch,
        ring_timeout_s=args.ring_timeout,
        keep_sessions=args.keep_sessions,
        session_idle_s=args.session_idle,
        threads=compute.threads,
        identity=identity or "plaintext",
        bounds=daemon_limits(args),
        store=store,
        fetch_from=(args.fetch_from,) if args.fetch_from else (),
        disk_budget_bytes=disk_budget,
        draft_model=compute.draft_model,
    )


def open_link_server(
    runtime: NodeRuntime,
    args: argparse.Namespace,
    identity: credentials.Identity | None,
    bounds: DaemonLimits,
    revoked: RevocationList | None,
) -> LinkServer | None:
    """The activation link beside the gRPC port (--link-port; 0, the default, picks a free
    port), advertised in Info so that peers find it; None with --link-port off."""
    if args.link_port is None:
        return None
    try:
        link = LinkServer(
            runtime, args.host, args.link_port, identity=identity, limits=bounds, revoked=revoked
        )
    except OSError as exc:
        raise InputError(
            f"--link-port {args.link_port}: cannot listen on {args.host}:{args.link_port} ({exc.strerror}); "
            "pick another port, or --link-port off to relay over gRPC"
        ) from None
    runtime.link_port = link.port
    return link


def fetch_model(args: argparse.Namespace, identity: credentials.Identity | None) -> SparseFile:
    """--fetch-from: the file at --model (a name's cache path, or a path), made a sparse copy
    of the model a source serves holding at least its header (see prima.net.fetch); the source
    (`mdns`: the first daemon advertising the whole file that passes the TLS check) becomes
    args.fetch_from. A source not up yet is waited for, up to --fetch-wait."""
    named = None if args.fetch_from == FETCH_FROM_MDNS else args.fetch_from
    if named is not None:
        check_address(named)
    else:
        stage("looking for a primad holding the whole model over mDNS", prog="primad")
    name = str(args.model)
    path = model_path(name) if name in KNOWN_MODELS else Path(name).expanduser()
    store, args.fetch_from = fetch_header(
        path,
        named=named,
        identity=identity,
        interfaces=args.mdns_interface,
        wait_s=args.fetch_wait,
        progress=lambda msg: stage(msg, prog="primad"),
    )
    log.info("fetched the header from %s", args.fetch_from)
    return store


def _serve_metrics(runtime: NodeRuntime, host: str, port: int | None) -> int | None:
    """Start the /metrics endpoint (prometheus_client's own HTTP server); its port, or None."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    from prima.daemon.hop_times import register_hop_times
    from prima.metrics import register_residency

    register_residency(runtime.residency)
    register_hop_times(runtime.worker.hop_times.since_start)
    try:
        httpd, _ = start_http_server(port, addr=host)
    except OSError as exc:
        raise InputError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
    return int(httpd.server_port)


def _announce_ready(
    runtime: NodeRuntime,
    host: str,
    port: int,
    budget: int | None,
    metrics_port: int | None = None,
    *,
    tls: bool,
) -> None:
    """The ready line, JSON on stdout for whoever started this daemon, and the same in words on
    stderr, saying how it can be called."""
    transport = "mutual TLS" if tls else "plaintext"
    how = (
        "mutual TLS: members of its cluster only"
        if tls
        else "plaintext gRPC: no cluster identity, any caller that reaches the port"
    )
    stage(f"{runtime.node_id} ready on {host}:{port} ({how})", prog="primad")
    ready = {
        "node_id": runtime.node_id,
        "address": f"{host}:{port}",
        "port": port,
        "pid": os.getpid(),
        "model": str(runtime.loaded.path),
        "n_layers": runtime.model.config.n_layers,
        "mem_budget": "auto" if budget is None else budget,
        "metrics_port": metrics_port,
        "link_port": runtime.link_port or None,
        "transport": transport,
    }
    print(READY_PREFIX + json.dumps(ready), flush=True)


if __name__ == "__main__":
    sys.exit(main())
