"""One primad behind the NodeHandler interface the gRPC servicer calls: its plan and the
admission of arriving activations. Its sessions (sessions), compute thread (worker), ring
generation (head), plan checks and windows (install), callers' rights (authorization) and
self-measurement (profile) are parts it owns.

RPC threads only validate and hand work on, which is why a malformed message can be answered
synchronously with a status while the daemon keeps serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from pathlib import Path

from prima.engine.draft_model import DraftModel
from prima.engine.generate import GenerateRequest, TokenEvent
from prima.errors import ProtocolError
from prima.forward.loader import LoadedModel
from prima.model.sparse import SparseFile
from prima.net import limits
from prima.net.client import Transport
from prima.net.codec import PROTOCOL_VERSION, Activation, NodeProfile, WireDType
from prima.net.fetch import Manifest, manifest_of
from prima.net.limits import DaemonLimits
from prima.net.node_status import FetchProgress, NodeStatus
from prima.net.status import NotReadyError, StaleEpochError
from prima.plan import Plan
from prima.weights.window import Residency

from .authorization import PlanOwnership
from .fetching import PlanFetch, WindowFetcher
from .head import Head
from .install import build_layout, check_plan
from .kept_sessions import DEFAULT_IDLE_S
from .node_profile import node_profile
from .sessions import Sessions, end_sessions
from .state import Layout, NodeSession, OwnHop
from .threads import use_threads
from .worker import INLINE_MAX_TOKENS, Worker

log = logging.getLogger("prima.daemon")

DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_RING_TIMEOUT_S = 300.0


class NodeRuntime:
    """One daemon behind the servicer (its NodeHandler): its plan, taken on at LoadPlan (and
    fetched first when the file holds only part of the model), and the admission of arriving
    activations; its sessions (`sessions`), compute thread (`worker`) and ring generation
    (`head`) are parts it owns."""

    def __init__(
        self,
        loaded: LoadedModel,
        node_id: str,
        *,
        budget_bytes: int | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        ring_timeout_s: float = DEFAULT_RING_TIMEOUT_S,
        threads: int | None = None,
        profile_cache_dir: Path | None = None,
        identity: Transport = None,
        bounds: DaemonLimits | None = None,
        store: SparseFile | None = None,
        fetch_from: tuple[str, ...] = (),
        disk_budget_bytes: int = 0,
        draft_model: DraftModel | None = None,
        keep_sessions: int = 0,
        session_idle_s: float = DEFAULT_IDLE_S,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.d_model = loaded.model.config.d_model
        self.vocab_size = loaded.model.config.vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.budget_bytes = budget_bytes  # None: auto, measured at each plan load
        self.threads = threads
        self.profile_cache_dir = profile_cache_dir
        self.identity = identity  # how this node calls its peers (see NodeClient)
        self.link_port = 0  # its activation link, once primad has opened one (prima.net.link_server)
        self.bounds = bounds or DaemonLimits()
        self.fingerprint = loaded.gguf.fingerprint()
        # The model file, whole or holding only some windows' bytes (fetched at LoadPlan).
        self.store = store or SparseFile.open(loaded.path, self.fingerprint)
        self.disk_budget_bytes = disk_budget_bytes  # 0: no cap on what the model file may hold
        self.fetcher = WindowFetcher(self.store, identity, fetch_from, disk_budget_bytes=disk_budget_bytes)
        self._fetch: PlanFetch | None = None  # the latest plan's background fetch, if it needed one
        self._lock = threading.Lock()
        self._profile_lock = threading.Lock()
        self._layout: Layout | None = None
        self._ownership: PlanOwnership | None = None  # who loaded the plan (its certificate's name)
        self.sessions = Sessions(self.model, node_id, self.bounds)
        self._node_id = node_id
        self.worker = Worker(self, threads, self.bounds)
        self.head = Head(
            self,
            self.worker,
            ring_timeout_s,
            threads,
            draft_model=draft_model,
            keep_sessions=keep_sessions,
            session_idle_s=session_idle_s,
        )

    @property
    def node_id(self) -> str:
        return self._node_id

    @node_id.setter
    def node_id(self, node_id: str) -> None:
        """primad names its node once it has a port; the sessions' messages say the new name."""
        self._node_id = self.sessions.node_id = node_id

    # -- info ----------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout | None:
        return self._layout

    def need_layout(self) -> Layout:
        layout = self._layout
        if layout is None:
            fetch = self._fetch
            if fetch is not None:
                raise NotReadyError(
                    f"node {self.node_id} is not ready: {describe_fetch(fetch.progress())}; "
                    "wait until its Info says ready"
                )
            raise NotReadyError(f"node {self.node_id} has no plan yet; send LoadPlan first")
        return layout

    @property
    def plan(self) -> Plan:
        return self.need_layout().plan

    def info(self) -> NodeStatus:
        layout = self._layout
        cfg = self.model.config
        fetch = self._fetch.progress() if self._fetch else None
        status = "ready" if layout else "idle: waiting for a plan"
        if self.sessions.stopping:
            status = f"shutting down: finishing {len(self.sessions)} session(s), taking no new ones"
        draft = self.head.draft_model
        if layout is None and fetch is not None:
            status = describe_fetch(fetch)
        return NodeStatus(
            node_id=self.node_id,
            protocol_version=PROTOCOL_VERSION,
            model_name=self.loaded.name,
            model_fingerprint=self.fingerprint,
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            healthy=not (fetch and fetch.error),
            status=status,
            plan_epoch=layout.plan.epoch if layout else fetch.plan_epoch if fetch else 0,
            windows=layout.plan.nodes[layout.me].windows if layout else (),
            residency=layout.windows.residency() if layout else None,
            sessions=len(self.sessions),
            fetch=fetch,
            holds_full_file=self.store.complete,
            hop_times=self.worker.hop_times.snapshot(layout.plan.epoch) if layout else (),
            draft_model_name=draft.name if draft else "",
            draft_model_fingerprint=draft.fingerprint if draft else "",
            link_port=self.link_port,
        )

    def manifest(self) -> Manifest:
        """What this node holds of its model file, for peers that fetch from it."""
        return manifest_of(self.store, self.loaded.name, self.loaded.gguf.data_offset)

    def residency(self) -> Residency | None:
        """What the current plan's layers hold in memory, None before a plan."""
        layout = self._layout
        return layout.windows.residency() if layout else None

    def profile(self, peer_address: str = "", refresh: bool = False) -> NodeProfile:
        if peer_address:
            limits.check_address(peer_address)
        use_threads(self.threads)
        with self._profile_lock:
            return node_profile(
                self.loaded,
                self.node_id,
                self.fingerprint,
                budget_bytes=self.budget_bytes,
                peer_address=peer_address,
                refresh=refresh,
                cache_dir=self.profile_cache_dir,
                identity=self.identity,
                store=self.store,
                disk_budget_bytes=self.disk_budget_bytes,
            )

    def authorize(self, rpc: str, caller: str | None) -> None:
        """PermissionDeniedError unless `caller` may make `rpc` (prima.daemon.authorization)."""
        ownership = self._ownership
        if ownership is not None and self._layout is not None:
            ownership.authorize(rpc, caller, self.node_id, len(self.sessions))

    # -- the plan ------------------------------------------------------------------------------
    def load_plan(
        self,
        plan: Plan,
        node_id: str,
        wire_dtype: WireDType,
        owner: str | None = None,
        fetch_sources: tuple[str, ...] = (),
    ) -> NodeStatus:
        """Take on this node's windows of `plan`; drops every session of the previous plan.
        `owner` (the caller's certificate name) alone may change the plan while it has sessions.
        A node holding only part of its model loads the plan once it has fetched (in the
        background, also from `fetch_sources`) the bytes of its windows; Info shows how far."""
        self.sessions.check_not_stopping("plan")
        me = check_plan(plan, node_id, self.loaded, self._current_epoch(), fetch_sources)
        pending = self._fetch
        if pending is not None and pending.plan == plan and pending.me == me and not pending.progress().error:
            return self.info()  # the same plan again (a retried call): its fetch goes on
        self._cancel_fetch()
        if self.store.partial:
            self._start_fetch(plan, me, wire_dtype, owner, fetch_sources)
            return self.info()
        self._install(plan, me, wire_dtype, owner)
        return self.info()

    def _current_epoch(self) -> int | None:
        """The epoch of the loaded plan, or of the plan being fetched if newer."""
        epochs = [x.plan.epoch for x in (self._layout, self._fetch) if x is not None]
        return max(epochs) if epochs else None

    def _start_fetch(
        self, plan: Plan, me: int, wire_dtype: WireDType, owner: str | None, sources: tuple[str, ...]
    ) -> None:
        """Drop the previous plan (its sessions end, as with any new plan) and fetch this one's
        windows in the background; the fetch loads the plan when it holds them."""
        fetch = PlanFetch(
            self.fetcher,
            self.loaded.gguf,
            plan,
            me,
            on_done=lambda written: self._install(plan, me, wire_dtype, owner, written, fetch),
            extra_sources=sources,
        )
        with self._lock:
            sessions = self.sessions.take_all()
            old, self._layout = self._layout, None
            self._ownership = PlanOwnership(plan, owner)
            self._fetch = fetch
        end_sessions(sessions, f"node {self.node_id} is fetching the windows of plan epoch {plan.epoch}")
        if old:
            old.close()
        fetch.start()

    def _cancel_fetch(self) -> None:
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            fetch.cancel()

    def _install(
        self,
        plan: Plan,
        me: int,
        wire_dtype: WireDType,
        owner: str | None,
        fetched_bytes: int = 0,
        fetch: PlanFetch | None = None,
    ) -> None:
        """Load node `me`'s windows of `plan`, whose bytes it holds, in place of the plan before
        (whose sessions end), unless a newer LoadPlan replaced it while it was fetched."""
        layout, keep = build_layout(
            self.loaded,
            plan,
            me,
            wire_dtype,
            node_id=self.node_id,
            budget_bytes=self.budget_bytes,
            identity=self.identity,
            fetched=bool(fetched_bytes),
        )
        with self._lock:
            stale = fetch is not None and (self._fetch is not fetch or fetch.cancelled)
            if not stale:
                # Taken before the layout changes: a session opened for the new plan stays.
                sessions = self.sessions.take_all()
                old, self._layout = self._layout, layout
                self._ownership = PlanOwnership(plan, owner)
        if stale:
            layout.close()
            return
        end_sessions(sessions, f"node {self.node_id} loaded plan epoch {plan.epoch}")
        self.model.release_windows(keep=keep)
        if old:
            old.close()
        windows = plan.nodes[me].windows
        log.info(
            "node %s: plan epoch %d, windows %s",
            plan.nodes[me].node_id,
            plan.epoch,
            " ".join(map(str, windows)),
        )

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None:
        limits.check_session_id(session_id)
        self.sessions.check_not_stopping("sessions")
        self.sessions.open(session_id, plan_epoch, n_ctx, self.need_layout())

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id, self._layout)

    def stop_taking_work(self) -> list[str]:
        """From now on refuse new plans and sessions (UNAVAILABLE, saying why); the sessions
        open now run on, but the idle ones the head kept for later requests close. Returns the
        ids of those that run on."""
        self.head.kept.release_all()
        return self.sessions.stop_taking_work()

    def session_ids(self) -> list[str]:
        return self.sessions.ids()

    def cut_session(self, session_id: str, why: str) -> None:
        """End an open session before its generation finished: its head's generation fails with
        `why` (a follower tells the head by Abort and closes the session; on the head the
        generation closes it as it ends)."""
        session = self.sessions.find(session_id)
        if session is None:
            return
        self.worker.fail(session_id, why, kind="shutdown")
        if session.results is None:
            self.close_session(session_id)

    def find_session(self, session_id: str) -> NodeSession | None:
        return self.sessions.find(session_id)

    def need_session(self, session_id: str) -> NodeSession:
        return self.sessions.need(session_id)

    def abort(self, session_id: str, node_id: str, message: str) -> None:
        """A node could not pass this session's activations on: end its generation here."""
        self.sessions.abort(session_id, node_id, message)

    # -- activations ---------------------------------------------------------------------------
    def accept(self, act: Activation) -> None:
        """Check an arriving activation against the plan and session, then queue it."""
        limits.check_session_id(act.session_id)
        layout = self.need_layout()
        if act.plan_epoch != layout.plan.epoch:
            raise StaleEpochError(
                f"activation for plan epoch {act.plan_epoch} but node {self.node_id} runs epoch {layout.plan.epoch}"
            )
        session = self.sessions.need(act.session_id)
        n_hops = len(layout.hops)
        if act.hop_index > n_hops or (act.hop_index == n_hops and not layout.is_head):
            raise ProtocolError(f"hop index {act.hop_index} is outside this plan's {n_hops} hops")
        if act.hop_index < n_hops and layout.hops[act.hop_index].node_index != layout.me:
            hop = layout.hops[act.hop_index]
            raise ProtocolError(
                f"hop {act.hop_index} (window {hop.window}) belongs to node "
                f"{layout.plan.nodes[hop.node_index].node_id}, not {self.node_id}; the sender's plan differs"
            )
        if int(act.positions[-1]) >= session.n_ctx:
            raise ProtocolError(
                f"position {int(act.positions[-1])} is beyond the session's context of {session.n_ctx}"
            )
        if act.hop_index == n_hops:
            session.hand_back(act, "a peer")  # it has been round the ring
        elif session.results is not None and len(act.positions) <= INLINE_MAX_TOKENS:
            # The head's own hop of a decode step: its generation thread, which waits for the
            # step, computes it. Computed here, the step would wake that thread only after this
            # one's bookkeeping, which holds the GIL it needs.
            session.hand_back(OwnHop(act), "a peer")
        else:
            self.worker.submit(act, layout, session)

    # -- the head ------------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Generator[TokenEvent, None, None]:
        return self.head.generate(request)

    def shutdown(self) -> None:
        """Call off a fetch, finish the batch in hand, then close sessions and channels (bounded
        wait)."""
        self._cancel_fetch()
        self.head.kept.release_all()
        self.worker.stop()
        layout = self._layout
        for session_id in self.sessions.ids():
            self.close_session(session_id)
        if layout:
            for c in layout.clients.values():
                c.close()
        self.store.close()


def describe_fetch(p: FetchProgress) -> str:
    """A fetch's state for people: Info's status and the error sessions get meanwhile."""
    if p.error:
        return f"fetch for plan epoch {p.plan_epoch} failed: {p.error}"
    gib = 1 << 30
    text = f"fetching its windows for plan epoch {p.plan_epoch}: {p.held_bytes / gib:.2f} of {p.needed_bytes / gib:.2f} GiB"
    if p.source:
        text += f" from {p.source}"
    if p.rate_bytes_per_s:
        text += f", {p.rate_bytes_per_s / (1 << 20):.1f} MiB/s, about {p.eta_s:.0f} s left"
    return text
