"""One primad behind the NodeHandler interface the gRPC servicer calls: the composition of its
parts, each with one job, and the interface met by handing each call to the part it belongs to:
the plan (plan_holder), Info (node_info), self-measurement (node_profile), callers' rights
(authorization), sessions and their KV caches (sessions), arriving activations (arrivals), the
compute thread (worker) and ring generation (head).

RPC threads only validate and hand work on, which is why a malformed message can be answered
synchronously with a status while the daemon keeps serving.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

from prima.engine.draft_model import DraftModel
from prima.engine.generate import GenerateRequest, TokenEvent
from prima.forward.loader import LoadedModel
from prima.model.sparse import SparseFile
from prima.net import limits
from prima.net.client import Transport
from prima.net.codec import Activation, NodeProfile, WireDType
from prima.net.fetch import Manifest, manifest_of
from prima.net.limits import DaemonLimits
from prima.net.node_status import NodeStatus
from prima.plan import Plan
from prima.weights.window import Residency

from .arrivals import Arrivals
from .fetching import WindowFetcher
from .head import Head
from .kept_sessions import DEFAULT_IDLE_S
from .node_info import NodeInfo
from .node_profile import NodeProfiler
from .plan_holder import PlanHolder
from .sessions import Sessions
from .state import Layout, NodeSession
from .worker import Worker

DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_RING_TIMEOUT_S = 300.0


class NodeRuntime:
    """One daemon behind the servicer (its NodeHandler), wired from its parts: its plan
    (`plans`, taken on at LoadPlan and fetched first when the file holds only part of the
    model), its sessions (`sessions`), the admission of arriving activations (`arrivals`), its
    compute thread (`worker`), its ring generation (`head`), its Info (`node_info`) and its
    self-measurement (`profiler`)."""

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
        self.identity = identity  # how this node calls its peers (see NodeClient)
        self.link_port = 0  # its activation link, once primad has opened one (prima.net.link_server)
        self.bounds = bounds or DaemonLimits()
        self.fingerprint = loaded.gguf.fingerprint()
        # The model file, whole or holding only some windows' bytes (fetched at LoadPlan).
        self.store = store or SparseFile.open(loaded.path, self.fingerprint)
        self._node_id = node_id
        self.sessions = Sessions(self.model, node_id, self.bounds)
        fetcher = WindowFetcher(self.store, identity, fetch_from, disk_budget_bytes=disk_budget_bytes)
        # budget_bytes None: auto, measured at each plan load
        self.plans = PlanHolder(
            loaded, self.sessions, fetcher, node_id, budget_bytes=budget_bytes, identity=identity
        )
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
        self.arrivals = Arrivals(self.plans, self.sessions, self.worker, node_id)
        self.node_info = NodeInfo(
            loaded,
            self.fingerprint,
            self.plans,
            self.sessions,
            self.worker.hop_times,
            self.store,
            draft_model,
        )
        self.profiler = NodeProfiler(
            loaded,
            self.fingerprint,
            budget_bytes=budget_bytes,
            threads=threads,
            cache_dir=profile_cache_dir,
            identity=identity,
            store=self.store,
            disk_budget_bytes=disk_budget_bytes,
        )

    @property
    def node_id(self) -> str:
        return self._node_id

    @node_id.setter
    def node_id(self, node_id: str) -> None:
        """primad names its node once it has a port; the parts' messages say the new name."""
        self._node_id = self.sessions.node_id = self.plans.node_id = self.arrivals.node_id = node_id

    # -- info ----------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout | None:
        return self.plans.layout

    def need_layout(self) -> Layout:
        return self.plans.need_layout()

    @property
    def plan(self) -> Plan:
        return self.plans.plan

    def info(self) -> NodeStatus:
        return self.node_info.status(self.node_id, self.link_port)

    def manifest(self) -> Manifest:
        """What this node holds of its model file, for peers that fetch from it."""
        return manifest_of(self.store, self.loaded.name, self.loaded.gguf.data_offset)

    def residency(self) -> Residency | None:
        """What the current plan's layers hold in memory, None before a plan."""
        return self.plans.residency()

    def profile(self, peer_address: str = "", refresh: bool = False) -> NodeProfile:
        return self.profiler.profile(self.node_id, peer_address, refresh)

    def authorize(self, rpc: str, caller: str | None) -> None:
        """PermissionDeniedError unless `caller` may make `rpc` (prima.daemon.authorization)."""
        ownership = self.plans.ownership
        if ownership is not None:
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
        """Take on this node's windows of `plan` (prima.daemon.plan_holder); drops every session
        of the previous plan. `owner` (the caller's certificate name) alone may change the plan
        while it has sessions. Info shows how far a fetch before it has come."""
        self.plans.load_plan(plan, node_id, wire_dtype, owner, fetch_sources)
        return self.info()

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None:
        limits.check_session_id(session_id)
        self.sessions.check_not_stopping("sessions")
        self.sessions.open(session_id, plan_epoch, n_ctx, self.need_layout())

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id, self.plans.layout)

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
        self.arrivals.accept(act)

    # -- the head ------------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Generator[TokenEvent, None, None]:
        return self.head.generate(request)

    def shutdown(self) -> None:
        """Call off a fetch, finish the batch in hand, then close sessions and channels (bounded
        wait)."""
        self.plans.cancel_fetch()
        self.head.kept.release_all()
        self.worker.stop()
        layout = self.plans.layout
        for session_id in self.sessions.ids():
            self.close_session(session_id)
        if layout:
            for c in layout.clients.values():
                c.close()
        self.store.close()
