"""primad's flags: what a daemon serves, how it computes, the bounds it holds callers to, and
its cluster identity; and the DaemonLimits those bounds make."""

from __future__ import annotations

import argparse
from pathlib import Path

from prima.cli.arg_types import (
    non_negative_int,
    positive_float,
    positive_int,
)
from prima.cli.stop_signals import add_shutdown_timeout_arg
from prima.daemon.fetch_source import DEFAULT_FETCH_WAIT_S
from prima.daemon.kept_sessions import DEFAULT_IDLE_S, DEFAULT_KEPT_SESSIONS
from prima.daemon.runtime import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_RING_TIMEOUT_S
from prima.model.registry import DEFAULT_MODEL
from prima.net import credentials
from prima.net.discovery import INTERFACES_ENV
from prima.net.limits import DaemonLimits
from prima.net.revocation import REVOKED_FILE

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
        default=DEFAULT_KEPT_SESSIONS,
        help="as the ring's head, keep up to N ring sessions open after generations that ask for it "
        "(prima chat, prima serve), so a request that continues one (a chat's next turn) sends only its "
        "new tokens round the ring; each holds KV memory on every node until it is idle for "
        f"--session-idle or a new session needs the room (default {DEFAULT_KEPT_SESSIONS}; 0: never)",
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
