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
    parse_budget,
    parse_disk_budget,
)
from prima.cli.primad_flags import FETCH_FROM_MDNS, build_parser, daemon_limits
from prima.cli.progress import StepBar, stage
from prima.cli.stop_signals import StopSignals
from prima.daemon.drain import drain
from prima.daemon.fetch_source import fetch_header
from prima.daemon.runtime import NodeRuntime
from prima.engine.ahead_of_time import compile_ahead
from prima.engine.compute import open_compute
from prima.errors import InputError, NodeError, PrimaError
from prima.model.registry import KNOWN_MODELS, model_path, resolve_model
from prima.model.sparse import SparseFile
from prima.net import credentials, invite
from prima.net.discovery import Advertiser
from prima.net.limits import DaemonLimits, check_address
from prima.net.link_server import LinkServer
from prima.net.node_adverts import NodeAdvert
from prima.net.revocation import REVOKED_FILE, RevocationList
from prima.net.server import start_server

log = logging.getLogger("prima.cli")

READY_PREFIX = "PRIMAD_READY "


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
