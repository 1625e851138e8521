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
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

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
from prima.engine.speculative import DEFAULT_DRAFT_MAX, DRAFT_METHODS, MAX_DRAFT_TOKENS, DraftConfig
from prima.engine.thread_tuning import tuned_setting
from prima.engine.warmup import ensure_compiled
from prima.errors import InputError, NodeError, PlanError
from prima.model.registry import DEFAULT_MODEL, resolve_model
from prima.net import mdns_names

# The engines, the ring and the model code (numba, grpc) load when a session opens, not when
# the flags are declared: `--help` stays fast.
if TYPE_CHECKING:
    from prima.coordinator.planner import ClusterView, HaldaOptions
    from prima.coordinator.ring import Ring
    from prima.engine.generate import GenerateRequest, GenerationResult, Generator, TextDecoder
    from prima.engine.sampling import SamplerConfig
    from prima.model.files import ModelFiles
    from prima.net.discovery import NodeAdvert

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
        "-t", "--threads", type=positive_int, default=None, help="compute threads (default: all cores)"
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
        default=DEFAULT_DRAFT_MAX,
        metavar="K",
        help=f"draft tokens per pass, at most {MAX_DRAFT_TOKENS} (default {DEFAULT_DRAFT_MAX})",
    )


def draft_from_args(args: argparse.Namespace) -> DraftConfig:
    """The --draft, --draft-model and --draft-max flags (plain decoding for commands without
    them). The draft model's fingerprint is filled in once the file is opened (open_session)."""
    method = getattr(args, "draft", "none")
    if getattr(args, "draft_model", None) is not None:
        if method not in ("none", "model"):
            raise InputError(
                f"--draft-model drafts with a model, --draft {method} without one: drop one of them"
            )
        method = "model"
    return DraftConfig(method, getattr(args, "draft_max", DEFAULT_DRAFT_MAX))


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


def discover_addresses(args: argparse.Namespace, fingerprint: str | None) -> list[str]:
    """The addresses of the cluster's daemons that answered over mDNS ([] if none did): adverts
    are hints, kept only when the daemon proves membership at a handshake (prima.coordinator.
    members). PlanError if fewer than --expect node ids answered."""
    from prima.coordinator.members import discover_members

    found = discover_members(
        args.discover_timeout,
        interfaces=args.mdns_interface,
        expect=args.expect,
        model_fingerprint=fingerprint,
    )
    if args.expect and len(found.node_ids) < args.expect:
        shown = ", ".join(f"{a.node_id} at {a.address}" for a in found.adverts)
        from prima.net import discovery

        clashes = [p.message for p in discovery.check_adverts(found.adverts) if p.kind == "duplicate_id"]
        advice = (
            "; ".join(clashes)
            or _far_advice(found.adverts)
            or (
                "start the others or pass --nodes host:port,... (multicast is often blocked by Wi-Fi "
                "client isolation and in containers)"
            )
        )
        raise PlanError(
            f"{len(found.node_ids)} member(s) answered within {args.discover_timeout:g} s (adverts: "
            f"{shown or 'none'}), expected {args.expect}; {advice}"
        )
    if found.adverts and not found.addresses and (advice := _far_advice(found.adverts)):
        print(f"prima: no daemon found over mDNS can be used: {advice}", file=sys.stderr)
    return list(found.addresses)


def _far_advice(adverts: Sequence[NodeAdvert]) -> str:
    """How to form a cluster, when this device has no identity and daemons elsewhere advertised
    (which such a device never uses); else ''."""
    from prima.coordinator.loopback_only import FORM_A_CLUSTER, split_loopback
    from prima.net import credentials

    if credentials.client_identity() is not None:
        return ""
    _, far = split_loopback([a.address for a in adverts], resolve=lambda _: [])
    return FORM_A_CLUSTER if far else ""


@dataclass
class Session:
    """What a text-generating command needs: the model (tokenizer, metadata) and a Generator
    that runs requests on this device or on a ring (`ring`, whose head samples)."""

    loaded: ModelFiles
    generator: Generator
    n_ctx: int
    closers: list[Callable[[], None]] = field(default_factory=list)
    ring: Ring | None = None
    draft: DraftConfig = field(default_factory=DraftConfig)

    def request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampler: SamplerConfig,
        want_prompt_logits: bool = False,
    ) -> GenerateRequest:
        """A request for this session's model and context, stopping at the model's stop ids."""
        from prima.engine.generate import GenerateRequest

        return GenerateRequest(
            tuple(int(t) for t in prompt_ids),
            max_tokens,
            sampler,
            tuple(sorted(self.loaded.tokenizer.stop_ids)),
            n_ctx=self.n_ctx,
            want_prompt_logits=want_prompt_logits,
            draft=self.draft,
        )

    def stream(
        self,
        request: GenerateRequest,
        *,
        stop_strings: Sequence[str] = (),
        decoder: TextDecoder | None = None,
    ) -> Iterator[str | GenerationResult]:
        """Text pieces, then the GenerationResult; closing it early cancels the generation."""
        from prima.engine.generate import check_prompt, stream_text

        check_prompt(request.prompt_ids, request.max_tokens, self.n_ctx)  # before any network
        return stream_text(
            self.generator.generate(request), request.prompt_ids, stop_strings=stop_strings, decoder=decoder
        )

    def generate(
        self,
        request: GenerateRequest,
        *,
        stop_strings: Sequence[str] = (),
        decoder: TextDecoder | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        from prima.engine.generate import collect

        return collect(self.stream(request, stop_strings=stop_strings, decoder=decoder), on_text)

    def close(self) -> None:
        for c in reversed(self.closers):
            c()


def _mode(args: argparse.Namespace) -> str:
    """The cpu backend's arithmetic: --exact, or int8 decode activations (q8)."""
    return "exact" if getattr(args, "exact", False) else "q8"


def open_session(args: argparse.Namespace) -> Session:
    """This device, or a ring: started here (--local-ring), named (--nodes) or discovered;
    its requests carry the --draft flags."""
    draft = draft_from_args(args)  # checked before the model is resolved
    session = _open_session(args)
    try:
        session.draft = _with_draft_model(args, session, draft)
    except BaseException:
        session.close()
        raise
    return session


def _with_draft_model(args: argparse.Namespace, session: Session, draft: DraftConfig) -> DraftConfig:
    """The draft config with the --draft-model file's fingerprint, its vocabulary checked
    against the model's here and a ring's head checked to draft with it, before any generation
    (refused now; after a failover the ring falls back instead: prima.coordinator.head_draft)."""
    from dataclasses import replace

    from prima.engine.draft_model import shared_vocabulary
    from prima.model.files import open_model

    if draft.method != "model":
        return draft
    if args.draft_model is None and session.ring is None:
        raise InputError(
            "--draft model on this device needs the draft's file: give --draft-model PATH_OR_NAME"
        )
    if args.draft_model is not None:
        files = open_model(args.draft_model, layers=range(0))
        shared_vocabulary(session.loaded, files)
        draft = replace(draft, model_fingerprint=files.gguf.fingerprint())
    if session.ring is not None:
        from prima.coordinator.head_draft import check_head_drafts

        check_head_drafts(draft, session.ring.head.info())
    return draft


def _open_session(args: argparse.Namespace) -> Session:
    if getattr(args, "mem_budget", None) is not None and not getattr(args, "local_ring", None):
        raise InputError(
            "--mem-budget sets the budget of the daemons --local-ring starts; give running daemons "
            "theirs with `primad --mem-budget`"
        )
    if args.local:  # before the ring's modules: one device loads no gRPC, mDNS or TLS (memory)
        return _local_session(args, resolve_model(args.model))
    from prima.coordinator.failover import FailoverRing, RingSpec
    from prima.coordinator.local_ring import LocalRing
    from prima.model.files import open_model
    from prima.net.codec import WireDType

    local_ring = getattr(args, "local_ring", None)
    nodes = getattr(args, "nodes", None)
    n_nodes = local_ring or len(nodes or ())
    if args.windows is not None and n_nodes and len(args.windows) != n_nodes:
        # Refused before the model is resolved (and perhaps downloaded) for nothing.
        raise InputError(
            f"--windows gives {len(args.windows)} window sizes for {n_nodes} nodes; give one per node"
        )
    # The coordinator only tokenizes: map the file without touching any layer or building compute.
    loaded = open_model(args.model, layers=range(0))
    addresses = list(nodes or ())
    if not local_ring and not nodes:
        addresses = discover_addresses(args, loaded.gguf.fingerprint())
        if not addresses:
            print(
                f"prima: no primad answered over mDNS within {args.discover_timeout:g} s; running on this "
                "device (--local skips the search)",
                file=sys.stderr,
            )
    if not local_ring and not addresses:
        return _local_session(args, loaded.path)
    closers: list[Callable[[], None]] = []
    try:
        if local_ring:
            _check_windows(args, [f"node{i}" for i in range(local_ring)], loaded.weights.config.n_layers)
            # Compiled here once, before the daemons start: they then load the kernels from the
            # cache instead of compiling side by side while the coordinator's calls time out.
            with StepBar("compiling") as bar:
                ensure_compiled(loaded.path, on_stage=stage, on_progress=bar)
            stage(f"starting {local_ring} primad daemon(s) on 127.0.0.1")
            exact = ("--exact",) if _mode(args) == "exact" else ()
            draft_model = getattr(args, "draft_model", None)
            # The first daemon is the head (the plan keeps the order given), the one that drafts.
            head = ("--draft-model", str(resolve_model(draft_model))) if draft_model else ()
            local = LocalRing.start(
                local_ring,
                loaded.path,
                threads=args.threads,
                extra_args=exact,
                node_args=[head, *([()] * (local_ring - 1))],
                mem_budgets=[args.mem_budget] * local_ring if args.mem_budget else None,
            )
            closers.append(local.close)
            addresses = local.addresses
        pick_head = not local_ring and not nodes  # discovered: adverts are hints
        ring = connect_ring(args, loaded, addresses, pick_head=pick_head, skip_untrusted=pick_head)
        closers.append(ring.close)
        n_ctx = min(args.ctx, loaded.weights.config.context_length)
        # Generations survive nodes leaving: re-planned over the daemons still answering.
        spec = RingSpec(
            tuple(addresses),
            halda_options(args, loaded, pick_head=pick_head),
            args.rounds or 1,
            WireDType.parse(args.wire_dtype),
            # A discovered ring keeps browsing: a re-plan also uses daemons that came back.
            _watch_adverts(args, loaded, closers) if pick_head else None,
        )
        return Session(loaded, FailoverRing(ring, spec), n_ctx, closers, ring)
    except BaseException:
        for c in reversed(closers):
            c()
        raise


def _watch_adverts(
    args: argparse.Namespace, loaded: ModelFiles, closers: list[Callable[[], None]]
) -> Callable[[], list[str]] | None:
    """For a discovered ring: the addresses of this model's daemons advertised at any moment (a
    browse kept open until the session closes), so a re-plan also uses daemons that came back."""
    from prima.coordinator.failover import advertised
    from prima.net import discovery

    try:
        watch = discovery.AdvertWatch(interfaces=args.mdns_interface)
    except NodeError as exc:
        log.warning("%s", exc)
        return None
    closers.append(watch.close)
    return partial(advertised, watch, loaded.gguf.fingerprint())


def _check_windows(args: argparse.Namespace, names: list[str], n_layers: int) -> None:
    """PlanError for --windows/--rounds that cannot cover the model on these nodes, raised
    before any daemon is started for them."""
    from prima.plan import plan_from_window_sizes

    if args.windows is not None:
        plan_from_window_sizes([(n, "") for n in names], args.windows, args.rounds or 1, n_layers)


def _local_session(args: argparse.Namespace, path: Path) -> Session:
    """The whole model on this device, its kernels compiled (once) before the model loads."""
    from prima.engine.local import local_generator
    from prima.forward.loader import load_model

    with StepBar("compiling") as bar:
        ensure_compiled(path, on_stage=stage, on_progress=bar)
    threads = args.threads
    if args.backend == "cpu":
        setting = tuned_setting(path, on_stage=stage, threads=threads)
        threads = setting.threads if setting else threads
    loaded = load_model(path, backend=args.backend, threads=threads, mode=_mode(args))
    draft_model = None
    if getattr(args, "draft_model", None) is not None:
        from prima.engine.draft_model import load_draft_model

        draft_model = load_draft_model(
            args.draft_model, loaded, backend=args.backend, threads=threads, mode=_mode(args)
        )
    generator = local_generator(
        loaded, args.ctx, parallel=getattr(args, "parallel", 1), draft_model=draft_model
    )
    return Session(loaded, generator, generator.n_ctx, [generator.close])


def connect_ring(
    args: argparse.Namespace,
    loaded: ModelFiles,
    addresses: list[str],
    *,
    pick_head: bool,
    skip_untrusted: bool = False,
) -> Ring:
    """Connect and load a plan: --windows/--rounds by hand, else Halda over the nodes' profiles
    (with `pick_head`, the node with the most memory becomes the head), then say in one line on
    stderr which node computes which layers and why any daemon left out is idle. `skip_untrusted`
    leaves out nodes that cannot prove cluster membership (discovered addresses: adverts are hints)."""
    from prima.coordinator.plan_summary import describe_plan
    from prima.coordinator.ring import Ring
    from prima.net.codec import WireDType
    from prima.scheduler.profile import ModelProfile

    halda = halda_options(args, loaded, pick_head=pick_head)
    if halda is not None:
        stage(f"profiling {len(addresses)} daemon(s) and planning the ring")
    with StepBar("planning") as bar, FetchBar() as fetch_bar:
        ring = Ring.connect(
            addresses,
            window_sizes=args.windows,
            rounds=args.rounds or 1,
            wire_dtype=WireDType.parse(args.wire_dtype),
            halda=halda,
            skip_untrusted=skip_untrusted,
            on_progress=bar,
            on_plan=_report_transfers,
            on_fetch=fetch_bar,
            serve_file=loaded.path,
            model=None if halda is not None else ModelProfile.from_gguf(loaded.gguf, ctx_tokens=args.ctx),
        )
    stage(describe_plan(ring.plan, ring.devices, halda.model if halda is not None else None))
    return ring


def _report_transfers(view: ClusterView) -> None:
    """Before a plan that makes nodes fetch layers is loaded: how much, and how long."""
    if view.transfers.n_bytes:
        stage(view.transfers.describe())


def halda_options(args: argparse.Namespace, loaded: ModelFiles, *, pick_head: bool) -> HaldaOptions | None:
    """How Halda plans the ring, or None when --windows or --rounds plan it by hand. With
    --draft-model the head's memory holds that model too; with a draft model, a node that has it
    heads a ring whose head Halda picks."""
    from prima.coordinator.planner import HaldaOptions
    from prima.scheduler.profile import ModelProfile

    if args.windows is not None or args.rounds is not None:
        return None
    model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=args.ctx)
    draft = draft_from_args(args)
    draft_model = getattr(args, "draft_model", None)
    if draft_model is not None:
        from dataclasses import replace

        from prima.model.files import open_model

        gguf = open_model(draft_model, layers=range(0)).gguf
        model = model.with_draft(gguf)
        draft = replace(draft, model_fingerprint=gguf.fingerprint())
    return HaldaOptions(
        model, max_rounds=args.max_rounds, refresh=args.reprofile, pick_head=pick_head, draft=draft
    )
