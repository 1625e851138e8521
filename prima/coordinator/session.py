"""Where a text-generating command runs its model, wired from one frozen `SessionOptions`: on
this device, on a ring of primad daemons started here (`local_ring`), named (`nodes`), or
found over mDNS (and on this device when none answers). The plan comes from Halda over the
daemons' profiles, or from `windows` (and `rounds`) by hand.

Nothing here prints: a slow start is reported through `Progress`, which the CLI draws.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from prima.backends.modes import cpu_mode
from prima.engine.compute import StepBars, no_bars, open_compute
from prima.engine.speculative import DraftConfig
from prima.errors import InputError, NodeError
from prima.model.registry import resolve_model

from .discovery_options import Discovery

# The ring's modules (grpc, mDNS, TLS) load only when a ring is wired: one device loads none.
if TYPE_CHECKING:
    from prima.engine.generate import GenerateRequest, GenerationResult, Generator, TextDecoder
    from prima.engine.sampling import SamplerConfig
    from prima.model.files import ModelFiles

    from .planner import ClusterView, HaldaOptions
    from .readiness import RingFetch
    from .ring import Ring

log = logging.getLogger("prima.coordinator")

OnFetch = Callable[["RingFetch"], None]


def _no_fetch_bar() -> AbstractContextManager[OnFetch | None]:
    return nullcontext(None)


@dataclass(frozen=True)
class Progress:
    """How a slow start is shown: one line per stage, a bar per stepped stage (compiling,
    planning), a bar of the bytes a ring's nodes fetch. The defaults log the lines only."""

    stage: Callable[[str], None] = log.info
    steps: StepBars = no_bars
    fetches: Callable[[], AbstractContextManager[OnFetch | None]] = _no_fetch_bar


QUIET = Progress()


@dataclass(frozen=True)
class SessionOptions:
    """Everything that chooses where and how a session runs, read once from the command line."""

    model: str
    ctx: int
    threads: int | None = None
    backend: str = "cpu"
    exact: bool = False  # float32 activations at decode, else int8 ("q8")
    draft: DraftConfig = field(default_factory=DraftConfig)
    draft_model: str | None = None  # a GGUF path or name to draft with
    parallel: int = 1  # generations at once on this device
    local: bool = False  # this device only: no search for daemons
    local_ring: int | None = None  # daemons to start on 127.0.0.1 for the session's lifetime
    nodes: tuple[str, ...] | None = None  # running daemons in ring order; the first is the head
    mem_budget: int | None = None  # bytes of layer weights each --local-ring daemon keeps
    windows: tuple[int, ...] | None = None  # layers per window per node, by hand
    rounds: int | None = None
    max_rounds: int | None = None
    reprofile: bool = False
    wire_dtype: str = "f32"
    discovery: Discovery = field(default_factory=Discovery)

    @property
    def mode(self) -> str:
        """The cpu backend's arithmetic: exact, or int8 decode activations (q8)."""
        return cpu_mode(self.exact)


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
        keep_session: bool = False,
    ) -> GenerateRequest:
        """A request for this session's model and context, stopping at the model's stop ids;
        `keep_session` for one that a next request will continue (a chat turn)."""
        from prima.engine.generate import GenerateRequest

        return GenerateRequest(
            tuple(int(t) for t in prompt_ids),
            max_tokens,
            sampler,
            tuple(sorted(self.loaded.tokenizer.stop_ids)),
            n_ctx=self.n_ctx,
            want_prompt_logits=want_prompt_logits,
            draft=self.draft,
            keep_session=keep_session,
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
        """The whole generation, its text pieces passed to `on_text` as they come."""
        from prima.engine.generate import collect

        return collect(self.stream(request, stop_strings=stop_strings, decoder=decoder), on_text)

    def close(self) -> None:
        """Stop what the session started (daemons, browses, channels), the last first."""
        for c in reversed(self.closers):
            c()


def open_session(options: SessionOptions, progress: Progress = QUIET) -> Session:
    """This device, or a ring: started here, named or discovered; its requests carry
    `options.draft` (with the draft model's fingerprint, once its file is opened)."""
    session = _open_session(options, progress)
    try:
        session.draft = _with_draft_model(options, session)
    except BaseException:
        session.close()
        raise
    return session


def _with_draft_model(options: SessionOptions, session: Session) -> DraftConfig:
    """The draft config with the draft model file's fingerprint, its vocabulary checked
    against the model's here and a ring's head checked to draft with it, before any generation
    (refused now; after a failover the ring falls back instead: prima.coordinator.head_draft)."""
    from prima.engine.draft_model import shared_vocabulary
    from prima.model.files import open_model

    draft = options.draft
    if draft.method != "model":
        return draft
    if options.draft_model is None and session.ring is None:
        raise InputError(
            "--draft model on this device needs the draft's file: give --draft-model PATH_OR_NAME"
        )
    if options.draft_model is not None:
        files = open_model(options.draft_model, layers=range(0))
        shared_vocabulary(session.loaded, files)
        draft = replace(draft, model_fingerprint=files.gguf.fingerprint())
    if session.ring is not None:
        from .head_draft import check_head_drafts

        check_head_drafts(draft, session.ring.head.info())
    return draft


def _open_session(options: SessionOptions, progress: Progress) -> Session:
    if options.mem_budget is not None and not options.local_ring:
        raise InputError(
            "--mem-budget sets the budget of the daemons --local-ring starts; give running daemons "
            "theirs with `primad --mem-budget`"
        )
    if options.local:  # before the ring's modules: one device loads no gRPC, mDNS or TLS (memory)
        return _local_session(options, resolve_model(options.model), progress)
    from prima.model.files import open_model

    from .members import discover_addresses

    n_nodes = options.local_ring or len(options.nodes or ())
    if options.windows is not None and n_nodes and len(options.windows) != n_nodes:
        # Refused before the model is resolved (and perhaps downloaded) for nothing.
        raise InputError(
            f"--windows gives {len(options.windows)} window sizes for {n_nodes} nodes; give one per node"
        )
    # The coordinator only tokenizes: map the file without touching any layer or building compute.
    loaded = open_model(options.model, layers=range(0))
    addresses = list(options.nodes or ())
    if not options.local_ring and not options.nodes:
        addresses = discover_addresses(options.discovery, loaded.gguf.fingerprint(), progress.stage)
        if not addresses:
            progress.stage(
                f"no primad answered over mDNS within {options.discovery.timeout_s:g} s; running on this "
                "device (--local skips the search)"
            )
    if not options.local_ring and not addresses:
        return _local_session(options, loaded.path, progress)
    return _ring_session(options, loaded, addresses, progress)


def _ring_session(
    options: SessionOptions, loaded: ModelFiles, addresses: list[str], progress: Progress
) -> Session:
    """A session on the daemons at `addresses`, or on `options.local_ring` started here first."""
    from prima.net.codec import WireDType

    from .failover import FailoverRing, RingSpec

    closers: list[Callable[[], None]] = []
    try:
        if options.local_ring:
            addresses = _start_local_ring(options, loaded, closers, progress)
        pick_head = not options.local_ring and not options.nodes  # discovered: adverts are hints
        ring = connect_ring(
            options, loaded, addresses, pick_head=pick_head, skip_untrusted=pick_head, progress=progress
        )
        closers.append(ring.close)
        n_ctx = min(options.ctx, loaded.weights.config.context_length)
        # Generations survive nodes leaving: re-planned over the daemons still answering.
        spec = RingSpec(
            tuple(addresses),
            halda_options(options, loaded, pick_head=pick_head),
            options.rounds or 1,
            WireDType.parse(options.wire_dtype),
            # A discovered ring keeps browsing: a re-plan also uses daemons that came back.
            _watch_adverts(options, loaded, closers) if pick_head else None,
        )
        return Session(loaded, FailoverRing(ring, spec), n_ctx, closers, ring)
    except BaseException:
        for c in reversed(closers):
            c()
        raise


def _start_local_ring(
    options: SessionOptions, loaded: ModelFiles, closers: list[Callable[[], None]], progress: Progress
) -> list[str]:
    """Start `options.local_ring` daemons on 127.0.0.1 (closed by `closers`); their addresses."""
    from prima.engine.warmup import ensure_compiled

    from .local_ring import LocalRing

    n = options.local_ring
    assert n
    _check_windows(options, [f"node{i}" for i in range(n)], loaded.weights.config.n_layers)
    # Compiled here once, before the daemons start: they then load the kernels from the
    # cache instead of compiling side by side while the coordinator's calls time out.
    with progress.steps("compiling") as bar:
        ensure_compiled(loaded.path, on_stage=progress.stage, on_progress=bar)
    progress.stage(f"starting {n} primad daemon(s) on 127.0.0.1")
    exact = ("--exact",) if options.exact else ()
    # They serve this process alone: the head keeps a session per generation that may run at
    # once, so a chat's next turn sends only its new tokens round the ring.
    keep = ("--keep-sessions", str(max(1, options.parallel)))
    # The first daemon is the head (the plan keeps the order given), the one that drafts.
    head = ("--draft-model", str(resolve_model(options.draft_model))) if options.draft_model else ()
    local = LocalRing.start(
        n,
        loaded.path,
        threads=options.threads,
        extra_args=(*exact, *keep),
        node_args=[head, *([()] * (n - 1))],
        mem_budgets=[options.mem_budget] * n if options.mem_budget else None,
    )
    closers.append(local.close)
    return local.addresses


def _watch_adverts(
    options: SessionOptions, loaded: ModelFiles, closers: list[Callable[[], None]]
) -> Callable[[], list[str]] | None:
    """For a discovered ring: the addresses of this model's daemons advertised at any moment (a
    browse kept open until the session closes), so a re-plan also uses daemons that came back."""
    from prima.net import discovery

    from .failover import advertised

    try:
        watch = discovery.AdvertWatch(interfaces=options.discovery.interfaces)
    except NodeError as exc:
        log.warning("%s", exc)
        return None
    closers.append(watch.close)
    return partial(advertised, watch, loaded.gguf.fingerprint())


def _check_windows(options: SessionOptions, names: list[str], n_layers: int) -> None:
    """PlanError for windows/rounds that cannot cover the model on these nodes, raised before
    any daemon is started for them."""
    from prima.plan import plan_from_window_sizes

    if options.windows is not None:
        plan_from_window_sizes([(n, "") for n in names], list(options.windows), options.rounds or 1, n_layers)


def _local_session(options: SessionOptions, path: Path, progress: Progress) -> Session:
    """The whole model on this device, its kernels compiled (once) before the model loads."""
    from prima.engine.local import local_generator

    compute = open_compute(
        path,
        backend=options.backend,
        threads=options.threads,
        mode=options.mode,
        draft_model=options.draft_model,
        draft_backend=options.backend,
        on_stage=progress.stage,
        steps=progress.steps,
    )
    generator = local_generator(
        compute.loaded, options.ctx, parallel=options.parallel, draft_model=compute.draft_model
    )
    return Session(compute.loaded, generator, generator.n_ctx, [generator.close])


def connect_ring(
    options: SessionOptions,
    loaded: ModelFiles,
    addresses: list[str],
    *,
    pick_head: bool,
    skip_untrusted: bool = False,
    progress: Progress = QUIET,
) -> Ring:
    """Connect and load a plan: windows/rounds by hand, else Halda over the nodes' profiles
    (with `pick_head`, the node with the most memory becomes the head), then say in one stage
    line which node computes which layers and why any daemon left out is idle. `skip_untrusted`
    leaves out nodes that cannot prove cluster membership (discovered addresses: adverts are hints)."""
    from prima.net.codec import WireDType
    from prima.scheduler.profile_schema import ModelProfile

    from .plan_summary import describe_plan
    from .ring import Ring

    halda = halda_options(options, loaded, pick_head=pick_head)
    if halda is not None:
        progress.stage(f"profiling {len(addresses)} daemon(s) and planning the ring")

    def report_transfers(view: ClusterView) -> None:
        """Before a plan that makes nodes fetch layers is loaded: how much, and how long."""
        if view.transfers.n_bytes:
            progress.stage(view.transfers.describe())

    with progress.steps("planning") as bar, progress.fetches() as fetch_bar:
        ring = Ring.connect(
            addresses,
            window_sizes=options.windows,
            rounds=options.rounds or 1,
            wire_dtype=WireDType.parse(options.wire_dtype),
            halda=halda,
            skip_untrusted=skip_untrusted,
            on_progress=bar,
            on_plan=report_transfers,
            on_fetch=fetch_bar,
            serve_file=loaded.path,
            model=None if halda is not None else ModelProfile.from_gguf(loaded.gguf, ctx_tokens=options.ctx),
        )
    progress.stage(describe_plan(ring.plan, ring.devices, halda.model if halda is not None else None))
    return ring


def halda_options(options: SessionOptions, loaded: ModelFiles, *, pick_head: bool) -> HaldaOptions | None:
    """How Halda plans the ring, or None when windows or rounds plan it by hand. With a draft
    model file the head's memory holds that model too, and a node that has it heads a ring
    whose head Halda picks."""
    from prima.scheduler.profile_schema import ModelProfile

    from .planner import HaldaOptions

    if options.windows is not None or options.rounds is not None:
        return None
    model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=options.ctx)
    draft = options.draft
    if options.draft_model is not None:
        from prima.model.files import open_model

        gguf = open_model(options.draft_model, layers=range(0)).gguf
        model = model.with_draft(gguf)
        draft = replace(draft, model_fingerprint=gguf.fingerprint())
    return HaldaOptions(
        model, max_rounds=options.max_rounds, refresh=options.reprofile, pick_head=pick_head, draft=draft
    )
