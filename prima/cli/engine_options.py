"""Flags that choose where a model runs, shared by `prima run`, `prima chat` and `prima serve`.

By default the command looks for primad daemons over mDNS for a few seconds and runs on the ring
they form; when none answers it runs on this device. `--local` skips the search, `--local-ring N`
starts N primad processes here for the command's lifetime, `--nodes host:port,...` uses daemons
already running (the first is the head). The plan comes from Halda over the daemons' profiles
(Profile RPC); `--windows` (and `--rounds`) set it by hand instead.
"""

from __future__ import annotations

import argparse
import logging

from prima.backends import AVAILABLE_BACKENDS
from prima.cli.arg_types import (
    mdns_interface,
    mem_budget,
    node_addresses,
    non_negative_float,
    positive_int,
    window_sizes,
)
from prima.cli.progress import FetchBar, StepBar, stage
from prima.coordinator import session
from prima.coordinator.discovery_options import Discovery
from prima.coordinator.session import Progress, Session, SessionOptions
from prima.engine.speculative import (
    DEFAULT_DRAFT_MAX,
    DRAFT_METHODS,
    MAX_DRAFT_TOKENS,
    RING_DRAFT_MAX,
    DraftConfig,
)
from prima.errors import InputError
from prima.model.registry import DEFAULT_MODEL
from prima.net import mdns_names

WIRE_DTYPES = (
    "f32",
    "f16",
    "bf16",
    "q8_block",
)  # prima.net.codec.WireDType's names (a test keeps them equal)

log = logging.getLogger("prima.cli")

DEFAULT_CTX = 2048  # tokens; `prima plan` sizes the KV cache for the same


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "-c",
        "--ctx",
        type=positive_int,
        default=DEFAULT_CTX,
        help=f"context size in tokens (default {DEFAULT_CTX})",
    )
    parser.add_argument(
        "-t",
        "--threads",
        type=positive_int,
        default=None,
        help="compute threads at most (default: all cores; decode runs fewer while other processes keep cores busy)",
    )
    parser.add_argument(
        "--backend", default="cpu", choices=AVAILABLE_BACKENDS, help="compute backend (default cpu)"
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="float32 activations at decode (default: int8 activations, as llama.cpp; faster, logits within ~1e-3)",
    )
    add_draft_args(parser)
    add_ring_args(parser)


def add_draft_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (same output, fewer passes on repetitive text)")
    g.add_argument(
        "--draft",
        default="none",
        choices=DRAFT_METHODS,
        help="draft tokens to check in one pass: lookup = repeat what followed the last few tokens "
        "earlier in the context; model = guess with a small model of the same vocabulary "
        "(--draft-model; on a ring of running daemons, the one the head's primad was started with) "
        "(default none)",
    )
    g.add_argument(
        "-md",
        "--draft-model",
        "--model-draft",
        dest="draft_model",
        default=None,
        metavar="PATH_OR_NAME",
        help="draft with this small GGUF (implies --draft model); it must share the model's vocabulary. "
        "It runs where tokens are sampled: here with --local, in the head daemon on a ring (--local-ring "
        "passes it to the daemons it starts; other rings' heads need `primad --draft-model` of the same file)",
    )
    g.add_argument(
        "--draft-max",
        type=positive_int,
        default=None,
        metavar="K",
        help=f"draft tokens per pass, at most {MAX_DRAFT_TOKENS} (default {DEFAULT_DRAFT_MAX} with --local, "
        f"{RING_DRAFT_MAX} on a ring, where kept drafts share a trip)",
    )


def draft_from_args(args: argparse.Namespace) -> DraftConfig:
    """The --draft, --draft-model and --draft-max flags; the draft model's fingerprint is filled
    in once its file is opened (open_session)."""
    method = args.draft
    if args.draft_model is not None:
        if method not in ("none", "model"):
            raise InputError(
                f"--draft-model drafts with a model, --draft {method} without one: drop one of them"
            )
        method = "model"
    if args.draft_max is not None:
        return DraftConfig(method, args.draft_max)
    return DraftConfig(method, DEFAULT_DRAFT_MAX if args.local else RING_DRAFT_MAX)


def add_ring_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ring (run the layers on primad daemons)")
    where = g.add_mutually_exclusive_group()
    where.add_argument(
        "--local", action="store_true", help="run on this device only; do not look for daemons"
    )
    where.add_argument(
        "--local-ring",
        type=positive_int,
        metavar="N",
        help="start N primad daemons on 127.0.0.1 for this command",
    )
    where.add_argument(
        "--nodes",
        type=node_addresses,
        metavar="HOST:PORT,...",
        help="running daemons in ring order; the first is the head",
    )
    g.add_argument(
        "--mem-budget",
        type=mem_budget,
        default=None,
        metavar="SIZE",
        help="with --local-ring: bytes of layer weights each daemon keeps in memory (primad --mem-budget), "
        "as if each were a small device; e.g. 25M, a third of the default model, splits it across three "
        "(default auto: what this machine leaves)",
    )
    add_discovery_args(g)
    g.add_argument(
        "--windows",
        type=window_sizes,
        metavar="W0,W1,...",
        help="layers per window for each node, by hand (default: Halda plans from the nodes' profiles)",
    )
    g.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="times the activations go round the ring; without --windows an even split (default: Halda)",
    )
    g.add_argument(
        "--max-rounds", type=positive_int, default=None, help="let Halda consider at most this many rounds"
    )
    g.add_argument(
        "--reprofile", action="store_true", help="have the daemons measure themselves again before planning"
    )
    g.add_argument(
        "--wire-dtype",
        default="f32",
        choices=WIRE_DTYPES,
        help="activation encoding between nodes (default f32, exact)",
    )


def add_discovery_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--discover-timeout",
        type=non_negative_float,
        default=mdns_names.DEFAULT_BROWSE_S,
        help=f"seconds to look for daemons over mDNS (default {mdns_names.DEFAULT_BROWSE_S:g})",
    )
    parser.add_argument(
        "--expect",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop looking once N daemons answered; fewer is an error instead of running here",
    )
    parser.add_argument(
        "--mdns-interface",
        action="append",
        type=mdns_interface,
        metavar="IP",
        help=f"this device's address to look for daemons on (default: ${mdns_names.INTERFACES_ENV}, else all)",
    )


def discovery_from_args(args: argparse.Namespace) -> Discovery:
    """The --discover-timeout, --expect and --mdns-interface flags."""
    interfaces = tuple(args.mdns_interface) if args.mdns_interface else None
    return Discovery(args.discover_timeout, interfaces, args.expect)


def discover_addresses(args: argparse.Namespace, fingerprint: str | None) -> list[str]:
    """The addresses of the daemons that answered over mDNS, as the discovery flags look for
    them (prima.coordinator.members); PlanError if fewer than --expect did."""
    from prima.coordinator.members import discover_addresses as discover

    return discover(discovery_from_args(args), fingerprint, stage)


def session_options(args: argparse.Namespace, *, parallel: int = 1) -> SessionOptions:
    """The flags of add_model_args, read once; `parallel` generations at once on this device."""
    return SessionOptions(
        model=str(args.model),
        ctx=args.ctx,
        threads=args.threads,
        backend=args.backend,
        exact=args.exact,
        draft=draft_from_args(args),
        draft_model=args.draft_model,
        parallel=parallel,
        local=args.local,
        local_ring=args.local_ring,
        nodes=tuple(args.nodes) if args.nodes else None,
        mem_budget=args.mem_budget,
        windows=tuple(args.windows) if args.windows is not None else None,
        rounds=args.rounds,
        max_rounds=args.max_rounds,
        reprofile=args.reprofile,
        wire_dtype=args.wire_dtype,
        discovery=discovery_from_args(args),
    )


# A slow start drawn on stderr: stage lines, and bars on a terminal.
PROGRESS = Progress(stage=stage, steps=StepBar, fetches=FetchBar)


def open_session(args: argparse.Namespace, *, parallel: int = 1) -> Session:
    """This device, or a ring: started here (--local-ring), named (--nodes) or discovered;
    its requests carry the --draft flags (prima.coordinator.session)."""
    return session.open_session(session_options(args, parallel=parallel), PROGRESS)
