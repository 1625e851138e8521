"""The state of one primad: its plan, its layer windows, its sessions' KV caches, and one compute
thread that runs each arriving activation through this node's windows and streams the result
straight to the node of the next hop.

Activations of every session go through one work queue and one compute thread, so a session's
micro-batches reach each layer in the order they were sent. RPC threads only validate and
enqueue, which is why a malformed message can be answered synchronously with a status.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prima import metrics
from prima.engine.generate import GenerationResult, generate
from prima.engine.local import DEFAULT_UBATCH
from prima.engine.sampling import SamplerConfig
from prima.errors import InputError, NodeError, PlanError, PrimaError, ProtocolError
from prima.model.loader import LoadedModel
from prima.net.client import NodeClient, RelayStream
from prima.net.codec import PROTOCOL_VERSION, Activation, NodeProfile, NodeStatus, WireDType
from prima.net.status import NotReadyError, StaleEpochError, UnknownSessionError
from prima.scheduler.memory import MemoryLimit, read_memory_limit
from prima.scheduler.plan import Hop, Plan
from prima.scheduler.profile import ModelProfile
from prima.scheduler.profile_cache import load_or_measure
from prima.weights.kv_cache import KVCache
from prima.weights.window import PAGE, LayerWindows, Residency, Span, resident_bytes

from .node_profile import measure_node
from .ring_engine import RingEngine

log = logging.getLogger("prima.cluster")

DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_RING_TIMEOUT_S = 300.0
_FINGERPRINT_SAMPLES = 16


def model_fingerprint(loaded: LoadedModel) -> str:
    """sha256 over the file size, the header and a few pages spread over the file: cheap (no
    full read) and equal for copies of one file on different devices."""
    data = loaded.gguf.data
    h = hashlib.sha256(str(data.size).encode())
    h.update(data[: loaded.gguf.data_offset].tobytes())
    for i in range(_FINGERPRINT_SAMPLES):
        at = data.size * i // _FINGERPRINT_SAMPLES
        h.update(data[at : at + 4096].tobytes())
    return h.hexdigest()


def use_threads(threads: int | None) -> None:
    """Apply --threads to the calling thread: numba's thread count is per thread, so a count set
    where the backend was built does not reach the daemon's compute and generate threads."""
    if threads is None:
        return
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


@dataclass
class NodeSession:
    """One session on this node: the KV cache of its own layers and its open Relay streams."""

    session_id: str
    epoch: int
    n_ctx: int
    cache: KVCache
    relays: dict[int, RelayStream] = field(default_factory=dict)
    results: queue.SimpleQueue[Activation | NodeError] | None = None  # head only

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()


@dataclass(frozen=True)
class _Layout:
    """The loaded plan as this node sees it."""

    plan: Plan
    me: int
    hops: tuple[Hop, ...]
    windows: LayerWindows
    clients: dict[int, NodeClient]
    wire_dtype: WireDType
    auto_budget: int | None  # the layer budget measured at plan load (auto), before any KV cache


class NodeRuntime:
    """Everything a primad does, behind the NodeHandler interface the gRPC servicer calls."""

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
    ) -> None:
        self.loaded = loaded
        self.threads = threads
        self.profile_cache_dir = profile_cache_dir
        self._profile_lock = threading.Lock()
        self.model = loaded.model
        self.node_id = node_id
        self.d_model = loaded.model.config.d_model
        self.max_batch_tokens = max_batch_tokens
        self.budget_bytes = budget_bytes
        self.ring_timeout_s = ring_timeout_s
        self.fingerprint = model_fingerprint(loaded)
        self._lock = threading.Lock()
        self._layout: _Layout | None = None
        self._sessions: dict[str, NodeSession] = {}
        self._work: queue.SimpleQueue[Activation | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._compute_loop, name="primad-compute", daemon=True)
        self._worker.start()

    # -- info and plan -------------------------------------------------------------------------
    def info(self) -> NodeStatus:
        layout = self._layout
        cfg = self.model.config
        return NodeStatus(
            node_id=self.node_id,
            protocol_version=PROTOCOL_VERSION,
            model_name=self.loaded.name,
            model_fingerprint=self.fingerprint,
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            healthy=True,
            status="ready" if layout else "idle: waiting for a plan",
            plan_epoch=layout.plan.epoch if layout else 0,
            windows=layout.plan.nodes[layout.me].windows if layout else (),
            residency=layout.windows.residency() if layout else None,
            sessions=len(self._sessions),
        )

    def residency(self) -> Residency | None:
        """What the current plan's layers hold in memory, None before a plan."""
        layout = self._layout
        return layout.windows.residency() if layout else None

    def profile(self, peer_address: str = "", refresh: bool = False) -> NodeProfile:
        """This device measured for the scheduler (cached per model file; `refresh` measures
        again), plus the link to `peer_address` when one is given."""
        use_threads(self.threads)
        with self._profile_lock:
            found = load_or_measure(
                self.node_id,
                self.fingerprint,
                lambda: measure_node(self.loaded, self.node_id),
                refresh=refresh,
                cache_dir=self.profile_cache_dir,
            )
        # Memory is read now, as the planner will use it: the cached profile's is from another time.
        limit = self._memory_limit()
        device = dataclasses.replace(
            found.profile, ram_total_bytes=limit.total, ram_available_bytes=limit.weights_budget()
        )
        if peer_address:
            peer = NodeClient(peer_address)
            try:
                latency_ms, bandwidth = peer.measure_link()
            finally:
                peer.close()
            device = dataclasses.replace(
                device, net_latency_ms=latency_ms, net_bandwidth_bytes_per_s=bandwidth
            )
        return NodeProfile(device, self.budget_bytes or 0, found.measured_unix_s)

    def _memory_limit(self) -> MemoryLimit:
        """This process's memory limit, the model file's own resident pages not counted as code."""
        data = self.loaded.gguf.data
        model_span = Span(0, data.size // PAGE * PAGE)
        return read_memory_limit(ours_mapped=resident_bytes(self.loaded.gguf, model_span))

    def _window_budget(self, is_head: bool) -> int:
        """Bytes of layer weights this node keeps resident: --mem-budget as given, or (auto) what
        its cgroup or host leaves now, less the output head the head node reads every token."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        limit = self._memory_limit()
        budget = limit.weights_budget()
        if is_head:
            budget -= ModelProfile.from_gguf(self.loaded.gguf).head_resident_bytes
        log.info("node %s: %s; layer budget %d MiB", self.node_id, limit.describe(), budget >> 20)
        return max(budget, 1)

    @property
    def plan(self) -> Plan:
        return self._need_layout().plan

    def load_plan(self, plan: Plan, node_id: str, wire_dtype: WireDType) -> NodeStatus:
        """Take on this node's windows of `plan`; drops every session of the previous plan."""
        cfg = self.model.config
        if plan.n_layers != cfg.n_layers:
            raise PlanError(
                f"the plan covers {plan.n_layers} layers but this node's model {self.loaded.name} has "
                f"{cfg.n_layers}; start every primad with the same --model"
            )
        ids = [n.node_id for n in plan.nodes]
        if node_id not in ids:
            raise PlanError(f"node id {node_id!r} is not in the plan (nodes: {ids})")
        current = self._layout
        if current and plan.epoch < current.plan.epoch:
            raise StaleEpochError(
                f"plan epoch {plan.epoch} is older than the loaded epoch {current.plan.epoch}; "
                "send a plan with a higher epoch"
            )
        me = ids.index(node_id)
        windows = plan.nodes[me].windows
        for w in windows:
            self.loaded.weights.validate(range(w.start, w.end))
        budget = self._window_budget(me == 0)
        layer_windows = LayerWindows(self.loaded.gguf, self.loaded.weights, windows, budget)
        if layer_windows.limited:
            layer_windows.release_all()  # start from a known resident set
        layer_windows.start()
        hops = tuple(plan.hops())
        peers = {h.node_index for h in hops} | {0}
        clients = {i: NodeClient(plan.nodes[i].address, plan.nodes[i].node_id) for i in peers if i != me}
        auto = budget if self.budget_bytes is None else None
        layout = _Layout(plan, me, hops, layer_windows, clients, wire_dtype, auto)
        with self._lock:
            old, self._layout = self._layout, layout
            sessions, self._sessions = self._sessions, {}
        for s in sessions.values():
            s.close()
            if s.results is not None:
                s.results.put(NodeError(f"session ended: node {self.node_id} loaded plan epoch {plan.epoch}"))
        if old:
            old.windows.close()
            for c in old.clients.values():
                c.close()
        log.info("node %s: plan epoch %d, windows %s", node_id, plan.epoch, " ".join(map(str, windows)))
        return self.info()

    def _need_layout(self) -> _Layout:
        layout = self._layout
        if layout is None:
            raise NotReadyError(f"node {self.node_id} has no plan yet; send LoadPlan first")
        return layout

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None:
        layout = self._need_layout()
        if plan_epoch != layout.plan.epoch:
            raise StaleEpochError(
                f"session {session_id} is for plan epoch {plan_epoch} but node {self.node_id} runs epoch "
                f"{layout.plan.epoch}; reload the plan on every node"
            )
        if not 0 < n_ctx <= self.model.config.context_length:
            raise InputError(f"context size {n_ctx} is outside [1, {self.model.config.context_length}]")
        layers = [i for w in layout.plan.nodes[layout.me].windows for i in range(w.start, w.end)]
        session = NodeSession(session_id, plan_epoch, n_ctx, KVCache(self.model.config, n_ctx, layers))
        with self._lock:
            if session_id in self._sessions:
                raise ProtocolError(f"session {session_id} is already open on node {self.node_id}")
            self._sessions[session_id] = session
            metrics.NODE_SESSIONS.set(len(self._sessions))
        try:
            self._fit_kv_caches(layout)
        except PrimaError:
            self.close_session(session_id)
            raise

    def _fit_kv_caches(self, layout: _Layout) -> None:
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
        with self._lock:
            session = self._sessions.pop(session_id, None)
            metrics.NODE_SESSIONS.set(len(self._sessions))
        if session is not None:
            session.close()
            layout = self._layout
            if layout is not None and session.epoch == layout.plan.epoch:
                self._fit_kv_caches(layout)

    def _session(self, session_id: str) -> NodeSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(
                f"node {self.node_id} has no session {session_id!r}; open it first (or it was closed)"
            )
        return session

    # -- activations ---------------------------------------------------------------------------
    def accept(self, act: Activation) -> None:
        """Check an arriving activation against the plan and session, then queue it."""
        layout = self._need_layout()
        if act.plan_epoch != layout.plan.epoch:
            raise StaleEpochError(
                f"activation for plan epoch {act.plan_epoch} but node {self.node_id} runs epoch {layout.plan.epoch}"
            )
        session = self._session(act.session_id)
        n_hops = len(layout.hops)
        if act.hop_index > n_hops or (act.hop_index == n_hops and layout.me != 0):
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
            self._deliver(session, act)
        else:
            self._work.put(act)

    def _compute_loop(self) -> None:
        use_threads(self.threads)
        pending: collections.deque[Activation | None] = collections.deque()
        while True:
            act = pending.popleft() if pending else self._work.get()
            if act is None:
                return
            group = [act]
            layout = self._layout
            if layout is not None and layout.windows.limited:
                # Streaming: micro-batches of one prompt waiting at the same hop go through each
                # layer together, so a streamed layer is read once for all of them, not once each.
                while True:
                    try:
                        pending.append(self._work.get_nowait())
                    except queue.Empty:
                        break
                while pending and _same_hop(pending[0], act):
                    group.append(pending.popleft())  # type: ignore[arg-type]
            metrics.NODE_QUEUE_DEPTH.set(self._work.qsize() + len(pending))
            try:
                with metrics.NODE_COMPUTE.time():
                    self._compute(group)
            except PrimaError as exc:
                self._fail(act.session_id, f"node {self.node_id}: {exc}", type(exc).__name__)
            except ValueError as exc:  # a cache write with a gap: the session's batches were lost
                self._fail(act.session_id, f"node {self.node_id} could not compute: {exc}", "cache_gap")

    def _compute(self, group: list[Activation]) -> None:
        """Run micro-batches of one session, all at the same hop, through this node's consecutive
        hops, layer by layer (each layer for every micro-batch in order), then route each on."""
        act = group[0]
        layout = self._layout
        session = self._sessions.get(act.session_id)
        if layout is None or session is None or act.plan_epoch != layout.plan.epoch:
            log.debug("dropping activation of closed session %s", act.session_id)
            return
        h = act.hop_index
        hidden = [a.hidden for a in group]
        windows = layout.windows
        while h < len(layout.hops) and layout.hops[h].node_index == layout.me:
            hop = layout.hops[h]
            before = dataclasses.replace(windows.stats)
            for layer in range(hop.window.start, hop.window.end):
                # Layer by layer, so compute on one overlaps the prefetch thread reading the next.
                windows.before_layer(layer)
                for i, a in enumerate(group):
                    hidden[i] = self.model.forward_layers(
                        hidden[i], a.positions, layer, layer + 1, session.cache
                    )
                windows.after_layer(layer)
            if log.isEnabledFor(logging.DEBUG):
                now = windows.stats
                log.debug(
                    "window %s (%d tokens): compute %.1f ms, waited %.1f ms for reads; prefetch read "
                    "%.1f MiB in %.1f ms",
                    hop.window,
                    sum(len(a.positions) for a in group),
                    now.compute_ms - before.compute_ms,
                    now.wait_ms - before.wait_ms,
                    (now.bytes_read - before.bytes_read) / (1 << 20),
                    now.read_ms - before.read_ms,
                )
            h += 1
        for a, out in zip(group, hidden, strict=True):
            self._route(layout, session, dataclasses.replace(a, hop_index=h, hidden=out))

    def inject(self, act: Activation) -> None:
        """The head sends a freshly embedded micro-batch into the ring."""
        layout = self._need_layout()
        self._route(layout, self._session(act.session_id), act)

    def _route(self, layout: _Layout, session: NodeSession, act: Activation) -> None:
        done = act.hop_index == len(layout.hops)
        dest = 0 if done else layout.hops[act.hop_index].node_index
        if dest == layout.me:
            if done:
                self._deliver(session, act)
            else:
                self._work.put(act)
            return
        if done:
            # Only the last token's hidden state is needed for the logits.
            act = dataclasses.replace(act, positions=act.positions[-1:], hidden=act.hidden[-1:])
        with self._lock:
            relay = session.relays.get(dest)
            if relay is None:
                sid = session.session_id
                relay = layout.clients[dest].relay(
                    lambda err: self._fail(sid, str(err), "relay"), layout.wire_dtype
                )
                session.relays[dest] = relay
        try:
            with metrics.NODE_RELAY_SEND.time():
                relay.send(act)
        except NodeError as exc:
            self._fail(session.session_id, str(exc), "relay")

    def _deliver(self, session: NodeSession, act: Activation) -> None:
        if session.results is None:
            raise ProtocolError(
                f"session {session.session_id} was not started on this node; only the head collects results"
            )
        session.results.put(act)

    def _fail(self, session_id: str, message: str, kind: str = "other") -> None:
        """Tell the head that a session cannot go on (or, on the head, wake its engine)."""
        log.warning("session %s failed: %s", session_id, message)
        metrics.NODE_ERRORS.labels(kind).inc()
        layout = self._layout
        session = self._sessions.get(session_id)
        if session is not None and session.results is not None:
            session.results.put(NodeError(message))
        elif layout is not None and layout.me != 0:
            try:
                layout.clients[0].abort(session_id, self.node_id, message)
            except NodeError as exc:
                log.warning("could not tell the head about it: %s", exc)

    def abort(self, session_id: str, node_id: str, message: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.results is not None:
            session.results.put(NodeError(message))

    # -- the head: ring sessions for RingEngine --------------------------------------------------
    def open_ring_session(self, session_id: str, n_ctx: int) -> None:
        layout = self._need_layout()
        if layout.me != 0:
            raise NotReadyError(
                f"node {self.node_id} is not the head of the plan; send this to {layout.plan.head.address}"
            )
        self.open_session(session_id, layout.plan.epoch, n_ctx)
        self._sessions[session_id].results = queue.SimpleQueue()
        try:
            for client in layout.clients.values():
                client.open_session(session_id, layout.plan.epoch, n_ctx)
        except NodeError:
            self.close_ring_session(session_id)
            raise

    def receive(self, session_id: str) -> Activation:
        session = self._session(session_id)
        assert session.results is not None
        try:
            item = session.results.get(timeout=self.ring_timeout_s)
        except queue.Empty:
            raise self._diagnose(session_id) from None
        if isinstance(item, NodeError):
            raise item
        return item

    def _diagnose(self, session_id: str) -> NodeError:
        """Name the node(s) that stopped answering after the ring went quiet."""
        layout = self._need_layout()
        dead = []
        for client in layout.clients.values():
            try:
                client.info(timeout_s=2.0)
            except NodeError:
                dead.append(f"{client.name} at {client.address}")
        if dead:
            return NodeError(
                f"session {session_id}: node(s) {', '.join(dead)} stopped answering; restart them"
            )
        return NodeError(
            f"session {session_id}: no answer from the ring within {self.ring_timeout_s:.0f} s "
            "although every node is up; check the nodes' logs"
        )

    def close_ring_session(self, session_id: str) -> None:
        layout = self._layout
        self.close_session(session_id)
        if layout is None:
            return
        for client in layout.clients.values():
            try:
                client.close_session(session_id)
            except NodeError as exc:
                log.info("closing session %s: %s", session_id, exc)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampler: SamplerConfig,
        stop_ids: list[int],
        n_ctx: int,
        cancelled: threading.Event,
        ubatch: int = 0,
    ) -> Iterator[int | GenerationResult]:
        """Run the shared generation loop on a RingEngine; yield token ids as they are sampled."""
        engine = RingEngine(self.model, self, n_ctx or 2048, ubatch or DEFAULT_UBATCH)
        events: queue.SimpleQueue[int | GenerationResult | PrimaError | None] = queue.SimpleQueue()

        def run() -> None:
            use_threads(self.threads)
            try:
                events.put(
                    generate(
                        engine,
                        prompt_ids,
                        max_tokens=max_tokens,
                        sampler=sampler,
                        stop_ids=stop_ids,
                        decoder=_TokenTap(events, cancelled),
                    )
                )
            except PrimaError as exc:
                events.put(exc)
            finally:
                events.put(None)
                engine.close()

        threading.Thread(target=run, name="primad-generate", daemon=True).start()
        while True:
            event = events.get()
            if event is None:
                return
            if isinstance(event, PrimaError):
                raise event
            yield event

    def open_forward(self, n_ctx: int, ubatch: int = 0) -> ForwardAdapter:
        engine = RingEngine(self.model, self, n_ctx or 2048, ubatch or DEFAULT_UBATCH)
        return ForwardAdapter(engine, self.threads)

    def shutdown(self) -> None:
        """Finish the batch in hand, then close sessions and channels (bounded wait)."""
        self._work.put(None)
        self._worker.join(timeout=30)
        layout = self._layout
        for session_id in list(self._sessions):
            self.close_session(session_id)
        if layout:
            for c in layout.clients.values():
                c.close()


def _same_hop(a: Activation | None, b: Activation) -> bool:
    return a is not None and (a.session_id, a.plan_epoch, a.hop_index) == (
        b.session_id,
        b.plan_epoch,
        b.hop_index,
    )


class GenerationCancelled(PrimaError):
    """The coordinator hung up; the generation loop stops at the next token."""


class _TokenTap:
    """A TextDecoder that hands each sampled token to the RPC thread instead of decoding it."""

    def __init__(self, events: queue.SimpleQueue, cancelled: threading.Event) -> None:
        self.events = events
        self.cancelled = cancelled

    def feed(self, token_id: int) -> str:
        if self.cancelled.is_set():
            raise GenerationCancelled("the coordinator cancelled the generation")
        self.events.put(int(token_id))
        return ""

    def flush(self) -> str:
        return ""


class ForwardAdapter:
    """A RingEngine driven by the coordinator's Forward stream."""

    def __init__(self, engine: RingEngine, threads: int | None = None) -> None:
        self.engine = engine
        self.threads = threads

    def forward(self, token_ids: list[int], reset: bool) -> np.ndarray:
        use_threads(self.threads)  # each call may come on another gRPC thread
        if reset:
            self.engine.reset()
        return self.engine.forward(token_ids)

    def close(self) -> None:
        self.engine.close()
