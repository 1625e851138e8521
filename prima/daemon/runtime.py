"""The state of one primad behind the NodeHandler interface the gRPC servicer calls: its plan,
its layer windows and its sessions. The compute thread (worker), ring generation (head) and
self-measurement (profile) are parts it owns.

RPC threads only validate and hand work on, which is why a malformed message can be answered
synchronously with a status while the daemon keeps serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from pathlib import Path

from prima import metrics
from prima.engine.draft_model import DraftModel
from prima.engine.generate import GenerateRequest, TokenEvent
from prima.errors import InputError, NodeError, PlanError, PrimaError, ProtocolError
from prima.forward.loader import LoadedModel
from prima.forward.placement import host_layers, split_window
from prima.model.sparse import SparseFile
from prima.net import limits
from prima.net.client import NodeClient, Transport
from prima.net.codec import PROTOCOL_VERSION, Activation, FetchProgress, NodeProfile, NodeStatus, WireDType
from prima.net.fetch import Manifest, manifest_of
from prima.net.limits import DaemonLimits, shown
from prima.net.status import (
    SHUTTING_DOWN,
    NotReadyError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ShuttingDownError,
    StaleEpochError,
    UnknownSessionError,
)
from prima.plan import Plan, Window
from prima.weights.kv_cache import kv_bytes
from prima.weights.window import LayerWindows, Residency

from .fetching import PlanFetch, WindowFetcher
from .head import Head
from .profile import node_profile, window_budget
from .state import Layout, NodeSession
from .threads import use_threads
from .worker import INLINE_MAX_TOKENS, Worker

log = logging.getLogger("prima.daemon")

DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_RING_TIMEOUT_S = 300.0


class NodeRuntime:
    """One daemon's plan and sessions; the servicer's NodeHandler."""

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
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.node_id = node_id
        self.d_model = loaded.model.config.d_model
        self.vocab_size = loaded.model.config.vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.budget_bytes = budget_bytes  # None: auto, measured at each plan load
        self.threads = threads
        self.profile_cache_dir = profile_cache_dir
        self.identity = identity  # how this node calls its peers (see NodeClient)
        self.link_port = 0  # its activation link, once primad has opened one (prima.net.link_server)
        self.bounds = bounds or DaemonLimits()
        self._owner: str | None = None  # who loaded the plan (its certificate's name)
        self.fingerprint = loaded.gguf.fingerprint()
        # The model file, whole or holding only some windows' bytes (fetched at LoadPlan).
        self.store = store or SparseFile.open(loaded.path, self.fingerprint)
        self.disk_budget_bytes = disk_budget_bytes  # 0: no cap on what the model file may hold
        self.fetcher = WindowFetcher(self.store, identity, fetch_from, disk_budget_bytes=disk_budget_bytes)
        self._fetch: PlanFetch | None = None  # the latest plan's background fetch, if it needed one
        self._lock = threading.Lock()
        self._profile_lock = threading.Lock()
        self._layout: Layout | None = None
        self._sessions: dict[str, NodeSession] = {}
        self._stopping = False  # SIGTERM: no new plan or session (prima.daemon.drain)
        self.worker = Worker(self, threads, self.bounds)
        self.head = Head(self, ring_timeout_s, threads, draft_model=draft_model)

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
        if self._stopping:
            status = f"shutting down: finishing {len(self._sessions)} session(s), taking no new ones"
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
            sessions=len(self._sessions),
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

    # -- who may call --------------------------------------------------------------------------
    def authorize(self, rpc: str, caller: str | None) -> None:
        """PermissionDeniedError unless `caller` (the node id in its verified certificate; None
        on a plaintext daemon, where nobody is checked) may make `rpc`: a plan is changed only by
        the coordinator that loaded it (or anyone once it has no sessions), and sessions are
        touched only by that coordinator and the plan's nodes."""
        layout = self._layout
        if caller is None or layout is None or self._owner is None or caller == self._owner:
            return
        if rpc == "LoadPlan":
            if self._sessions:
                raise PermissionDeniedError(
                    f"plan epoch {layout.plan.epoch} of node {self.node_id} belongs to coordinator "
                    f"{shown(self._owner)} and has {len(self._sessions)} open session(s); only it may "
                    "change the plan until they end"
                )
            return
        if caller not in {n.node_id for n in layout.plan.nodes}:
            raise PermissionDeniedError(
                f"{shown(caller)} is neither a node of plan epoch {layout.plan.epoch} nor the coordinator "
                f"that loaded it; it may not call {rpc} on node {self.node_id}"
            )

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
        self._check_not_stopping("plan")
        cfg = self.model.config
        current_epoch = self._current_epoch()
        limits.check_epoch(plan.epoch, current_epoch)
        limits.check_node_id(node_id)
        for n in plan.nodes:
            limits.check_node_id(n.node_id)
            limits.check_address(n.address)
        if plan.n_layers != cfg.n_layers:
            raise PlanError(
                f"the plan covers {plan.n_layers} layers but this node's model {self.loaded.name} has "
                f"{cfg.n_layers}; start every primad with the same --model"
            )
        ids = [n.node_id for n in plan.nodes]
        if node_id not in ids:
            raise PlanError(f"node id {shown(node_id)} is not in the plan (nodes: {ids})")
        for a in fetch_sources:
            limits.check_address(a)
        if current_epoch is not None and plan.epoch < current_epoch:
            raise StaleEpochError(
                f"plan epoch {plan.epoch} is older than the loaded epoch {current_epoch}; "
                "send a plan with a higher epoch"
            )
        me = ids.index(node_id)
        accel = plan.nodes[me].accel_layers
        if accel and not self.model.backend.accelerator:
            raise PlanError(
                f"the plan puts {accel} layers of node {node_id} on an accelerator, but it computes on "
                f"the {self.model.backend.name} backend only; plan again from the nodes' profiles"
            )
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
            old, self._layout = self._layout, None
            sessions, self._sessions = self._sessions, {}
            self._owner = owner
            self._fetch = fetch
        self._end_sessions(
            sessions, f"node {self.node_id} is fetching the windows of plan epoch {plan.epoch}"
        )
        if old:
            old.windows.close()
            for c in old.clients.values():
                c.close()
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
        """Load node `me`'s windows of `plan`, whose bytes it holds; forget the views of layers
        built over holes before a fetch (the profile may have timed them)."""
        windows = plan.nodes[me].windows
        accel = plan.nodes[me].accel_layers
        if fetched_bytes:
            mine = {i for w in windows for i in range(w.start, w.end)}
            self.loaded.weights.forget_layers(mine)
            self.model.release_layers(mine)
        for w in windows:
            self.loaded.weights.validate(range(w.start, w.end))
        # The accelerator's part of each window is one compiled model, readied now (an NPU
        # compiles it unless cached); the host's part is read by the layer windows below.
        spans = [range(w.start, w.end) for w in windows]
        for span in spans:
            for piece in split_window(span, accel):
                if piece.on_accel:
                    self.model.window(piece)
        auto = self.budget_bytes is None
        budget = window_budget(self.loaded, self.node_id, me == 0) if auto else self.budget_bytes
        assert budget is not None
        host_windows = [Window(r.start, r.stop) for r in (host_layers(s, accel) for s in spans)]
        layer_windows = LayerWindows(self.loaded.gguf, self.loaded.weights, host_windows, budget)
        if layer_windows.limited:
            layer_windows.release_all()  # start from a known resident set
        layer_windows.start()
        # The host runs a window's layers in one call, or one by one while it streams (see the
        # worker): either form may be asked for, so both are kept; the current one is readied.
        keep = {
            p
            for s in spans
            for per_layer in (False, True)
            for p in split_window(s, accel, per_layer=per_layer)
        }
        for span in spans:
            for piece in split_window(span, accel, per_layer=layer_windows.limited):
                self.model.window(piece)
        hops = tuple(plan.hops())
        peers = {h.node_index for h in hops} | {0}
        clients = {
            i: NodeClient(plan.nodes[i].address, node_id=plan.nodes[i].node_id, identity=self.identity)
            for i in peers
            if i != me
        }
        layout = Layout(plan, me, hops, layer_windows, clients, wire_dtype, budget if auto else None)
        with self._lock:
            if fetch is not None and (self._fetch is not fetch or fetch.cancelled):
                stale = True  # a newer LoadPlan replaced this one while it was fetched
            else:
                stale = False
                old, self._layout = self._layout, layout
                sessions, self._sessions = self._sessions, {}
                self._owner = owner
        if stale:
            layout.windows.close()
            for c in clients.values():
                c.close()
            return
        self._end_sessions(sessions, f"node {self.node_id} loaded plan epoch {plan.epoch}")
        self.model.release_windows(keep=keep)
        if old:
            old.windows.close()
            for c in old.clients.values():
                c.close()
        log.info(
            "node %s: plan epoch %d, windows %s",
            plan.nodes[me].node_id,
            plan.epoch,
            " ".join(map(str, windows)),
        )

    def _end_sessions(self, sessions: dict[str, NodeSession], why: str) -> None:
        for s in sessions.values():
            s.close()
            if s.results is not None:
                s.results.put(NodeError(f"session ended: {why}"))

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None:
        limits.check_session_id(session_id)
        self._check_not_stopping("sessions")
        layout = self.need_layout()
        if plan_epoch != layout.plan.epoch:
            raise StaleEpochError(
                f"session {shown(session_id)} is for plan epoch {plan_epoch} but node {self.node_id} runs epoch "
                f"{layout.plan.epoch}; reload the plan on every node"
            )
        if not 0 < n_ctx <= self.model.config.context_length:
            raise InputError(f"context size {n_ctx} is outside [1, {self.model.config.context_length}]")
        # Refused before the cache exists: allocating it first and freeing it on refusal leaves
        # the pages resident (the allocator keeps them), so spam would grow the daemon. (Counted
        # as float32 KV: a cache of halves, on the host or an accelerator, takes at most that.)
        with self._lock:
            self._check_room(kv_bytes(self.model.config, n_ctx, len(set(layout.layers())), "float32"))
        # The backends keep the KV state (the acl backend: on the NPU, for its layers).
        host = layout.host_layers()
        accel = [i for i in layout.layers() if i not in set(host)]
        session = NodeSession(session_id, plan_epoch, n_ctx, self.model.new_split_cache(n_ctx, accel, host))
        with self._lock:
            self._check_not_stopping("sessions")  # stop_taking_work may have come meanwhile
            if session_id in self._sessions:
                raise ProtocolError(f"session {shown(session_id)} is already open on node {self.node_id}")
            self._check_room(session.cache.n_bytes)
            self._sessions[session_id] = session
            metrics.NODE_SESSIONS.set(len(self._sessions))
        try:
            self._fit_kv_caches(layout)
        except PrimaError:
            self.close_session(session_id)
            raise

    def _check_room(self, kv_bytes: int) -> None:
        """PayloadTooLargeError if one more session (holding `kv_bytes`) passes the bounds."""
        if len(self._sessions) >= self.bounds.max_sessions:
            raise PayloadTooLargeError(
                f"node {self.node_id} already holds {len(self._sessions)} sessions, its limit; close some first"
            )
        held = sum(s.cache.n_bytes for s in self._sessions.values())
        if held + kv_bytes > self.bounds.max_kv_bytes:
            raise PayloadTooLargeError(
                f"node {self.node_id}: a session of {kv_bytes >> 20} MiB KV cache would pass its "
                f"{self.bounds.max_kv_bytes >> 20} MiB for KV caches ({held >> 20} MiB held); lower n_ctx "
                "or wait for sessions to close"
            )

    def _fit_kv_caches(self, layout: Layout) -> None:
        """Under an auto budget, the sessions' KV caches (anonymous memory, allocated for their
        whole context) come out of what the layers may keep resident."""
        if layout.auto_budget is None:
            return
        kv = sum(s.cache.n_bytes for s in list(self._sessions.values()))
        budget = layout.auto_budget - kv
        if budget < layout.windows.largest_layer_bytes:
            raise InputError(
                f"node {self.node_id}: the sessions' KV caches ({kv >> 20} MiB) leave no room for its layers "
                f"in {layout.auto_budget >> 20} MiB; lower --ctx or add a device"
            )
        layout.windows.set_budget(budget)

    def close_session(self, session_id: str) -> None:
        limits.check_session_id(session_id)
        with self._lock:
            session = self._sessions.pop(session_id, None)
            metrics.NODE_SESSIONS.set(len(self._sessions))
        if session is not None:
            session.close()
            layout = self._layout
            if layout is not None and session.epoch == layout.plan.epoch:
                self._fit_kv_caches(layout)

    # -- stopping ------------------------------------------------------------------------------
    def stop_taking_work(self) -> list[str]:
        """From now on refuse new plans and sessions (UNAVAILABLE, saying why); the sessions
        open now run on. Returns their ids."""
        with self._lock:
            self._stopping = True
            return list(self._sessions)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def cut_session(self, session_id: str, why: str) -> None:
        """End an open session before its generation finished: its head's generation fails with
        `why` (a follower tells the head by Abort and closes the session; on the head the
        generation closes it as it ends)."""
        session = self.find_session(session_id)
        if session is None:
            return
        self.worker.fail(session_id, why, kind="shutdown")
        if session.results is None:
            self.close_session(session_id)

    def _check_not_stopping(self, what: str) -> None:
        if self._stopping:
            raise ShuttingDownError(
                f"node {self.node_id} {SHUTTING_DOWN}: it takes no new {what}; "
                "send it to another node, or plan again without this one"
            )

    def find_session(self, session_id: str) -> NodeSession | None:
        return self._sessions.get(session_id)

    def need_session(self, session_id: str) -> NodeSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(
                f"node {self.node_id} has no session {shown(session_id)}; open it first (or it was closed)"
            )
        return session

    # -- activations ---------------------------------------------------------------------------
    def accept(self, act: Activation) -> None:
        """Check an arriving activation against the plan and session, then queue it."""
        limits.check_session_id(act.session_id)
        layout = self.need_layout()
        if act.plan_epoch != layout.plan.epoch:
            raise StaleEpochError(
                f"activation for plan epoch {act.plan_epoch} but node {self.node_id} runs epoch {layout.plan.epoch}"
            )
        session = self.need_session(act.session_id)
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
            # step, computes it (Head.receive). Computed here, the step would wake that thread
            # only after this one's bookkeeping, which holds the GIL it needs.
            session.hand_back(act, "a peer")
        else:
            self.worker.submit(act, layout, session)

    def route(self, layout: Layout, session: NodeSession, act: Activation) -> None:
        self.worker.route(layout, session, act)

    def abort(self, session_id: str, node_id: str, message: str) -> None:
        """A node could not pass this session's activations on: end its generation here."""
        limits.check_session_id(session_id)
        session = self._sessions.get(session_id)
        if session is not None and session.results is not None and not session.aborted:
            session.aborted = True  # the first ends the generation; a flood of them queues nothing
            session.results.put(NodeError(f"node {shown(node_id)}: {message[: limits.MAX_MESSAGE_CHARS]}"))

    # -- the head ------------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Generator[TokenEvent, None, None]:
        return self.head.generate(request)

    def shutdown(self) -> None:
        """Call off a fetch, finish the batch in hand, then close sessions and channels (bounded
        wait)."""
        self._cancel_fetch()
        self.worker.stop()
        layout = self._layout
        for session_id in list(self._sessions):
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
