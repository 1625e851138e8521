"""Flags that choose where a model runs, shared by `prima run`, `prima chat` and `prima serve`.

This device by default; `--local-ring N` starts N primad processes here for the command's
lifetime, `--nodes host:port,...` uses daemons already running (the first is the head). Until
the scheduler picks windows, the plan is an even split; `--windows` and `--rounds` set it by hand.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from prima.cluster.coordinator import Ring
from prima.cluster.local_ring import LocalRing
from prima.engine.generate import Engine
from prima.engine.local import LocalEngine
from prima.errors import InputError
from prima.model.loader import LoadedModel, load_model
from prima.model.registry import DEFAULT_MODEL
from prima.net.codec import WireDType


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("-c", "--ctx", type=int, default=2048, help="context size in tokens (default 2048)")
    parser.add_argument(
        "-t", "--threads", type=int, default=None, help="compute threads (default: all cores)"
    )
    parser.add_argument("--backend", default="cpu", help="compute backend (default cpu)")
    add_ring_args(parser)


def add_ring_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ring (run the layers on primad daemons)")
    where = g.add_mutually_exclusive_group()
    where.add_argument(
        "--local-ring", type=int, metavar="N", help="start N primad daemons on 127.0.0.1 for this command"
    )
    where.add_argument(
        "--nodes", metavar="HOST:PORT,...", help="running daemons in ring order; the first is the head"
    )
    g.add_argument(
        "--windows", metavar="W0,W1,...", help="layers per window for each node (default: even split)"
    )
    g.add_argument(
        "--rounds", type=int, default=1, help="times the activations go round the ring (default 1)"
    )
    g.add_argument(
        "--wire-dtype",
        default="f32",
        choices=[d.name.lower() for d in WireDType],
        help="activation encoding between nodes (default f32, exact)",
    )


@dataclass
class Session:
    """What a text-generating command needs: the model (tokenizer, metadata) and an engine."""

    loaded: LoadedModel
    engine: Engine
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close:
            close()
        for c in reversed(self.closers):
            c()


def parse_windows(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(w) for w in text.split(",")]
    except ValueError:
        raise InputError(f"--windows takes layer counts like 10,10,10, got {text!r}") from None


def parse_nodes(text: str) -> list[str]:
    nodes = [n.strip() for n in text.split(",") if n.strip()]
    for n in nodes:
        host, _, port = n.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"--nodes takes host:port,host:port,..., got {n!r}")
    return nodes


def open_session(args: argparse.Namespace) -> Session:
    local_ring = getattr(args, "local_ring", None)
    nodes = getattr(args, "nodes", None)
    if not local_ring and not nodes:
        loaded = load_model(args.model, backend=args.backend, threads=args.threads)
        return Session(loaded, LocalEngine(loaded.model, n_ctx=args.ctx))
    # The coordinator only tokenizes: map the file without touching any layer.
    loaded = load_model(args.model, backend=args.backend, threads=args.threads, layers=range(0))
    closers: list[Callable[[], None]] = []
    try:
        if local_ring:
            local = LocalRing.start(local_ring, loaded.path, threads=args.threads)
            closers.append(local.close)
            addresses = local.addresses
        else:
            addresses = parse_nodes(nodes)
        ring = Ring.connect(
            addresses,
            window_sizes=parse_windows(args.windows),
            rounds=args.rounds,
            wire_dtype=WireDType.parse(args.wire_dtype),
        )
        closers.append(ring.close)
        return Session(loaded, ring.engine(args.ctx), closers)
    except BaseException:
        for c in reversed(closers):
            c()
        raise
