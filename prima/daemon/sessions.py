"""A daemon's open sessions, within its bounds: how many it holds, and how much memory their KV
caches take together (and, under an auto budget, how that leaves room for the layers).

A cache is refused before it exists: allocating it first and freeing it on refusal leaves the
pages resident (the allocator keeps them), so a flood of opens would grow the daemon.
"""

from __future__ import annotations

import threading

from prima import metrics
from prima.errors import InputError, NodeError, PrimaError, ProtocolError
from prima.forward.windowed_model import WindowedModel
from prima.net import limits
from prima.net.limits import DaemonLimits, shown
from prima.net.status import (
    SHUTTING_DOWN,
    PayloadTooLargeError,
    ShuttingDownError,
    StaleEpochError,
    UnknownSessionError,
)
from prima.weights.kv_cache import kv_bytes

from .state import Layout, NodeSession


class Sessions:
    """The sessions of one daemon by id, opened against its current layout and `bounds`. After
    `stop_taking_work` it opens none (nor takes a plan: `check_not_stopping`)."""

    def __init__(self, model: WindowedModel, node_id: str, bounds: DaemonLimits) -> None:
        self.model = model
        self.node_id = node_id  # for messages; primad names its node once it has a port
        self.bounds = bounds
        self._lock = threading.Lock()
        self._open: dict[str, NodeSession] = {}
        self._stopping = False

    def __len__(self) -> int:
        return len(self._open)

    def ids(self) -> list[str]:
        return list(self._open)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def open(self, session_id: str, plan_epoch: int, n_ctx: int, layout: Layout) -> NodeSession:
        """Open a session of `layout`'s plan with a KV cache of `n_ctx` positions for this node's
        layers; refused (PayloadTooLargeError) past the bounds, or when the layers would have
        no room left under an auto budget."""
        limits.check_session_id(session_id)
        self.check_not_stopping("sessions")
        if plan_epoch != layout.plan.epoch:
            raise StaleEpochError(
                f"session {shown(session_id)} is for plan epoch {plan_epoch} but node {self.node_id} runs epoch "
                f"{layout.plan.epoch}; reload the plan on every node"
            )
        cfg = self.model.config
        if not 0 < n_ctx <= cfg.context_length:
            raise InputError(f"context size {n_ctx} is outside [1, {cfg.context_length}]")
        # Counted as float32 KV: a cache of halves, on the host or an accelerator, takes at most that.
        with self._lock:
            self._check_room(kv_bytes(cfg, n_ctx, len(set(layout.layers())), "float32"))
        # The backends keep the KV state (the acl backend: on the NPU, for its layers).
        host = layout.host_layers()
        accel = [i for i in layout.layers() if i not in set(host)]
        session = NodeSession(session_id, plan_epoch, n_ctx, self.model.new_split_cache(n_ctx, accel, host))
        with self._lock:
            self.check_not_stopping("sessions")  # stop_taking_work may have come meanwhile
            if session_id in self._open:
                raise ProtocolError(f"session {shown(session_id)} is already open on node {self.node_id}")
            self._check_room(session.cache.n_bytes)
            self._open[session_id] = session
            metrics.NODE_SESSIONS.set(len(self._open))
        try:
            self.fit_kv_caches(layout)
        except PrimaError:
            self.close(session_id, layout)
            raise
        return session

    def _check_room(self, n_bytes: int) -> None:
        """PayloadTooLargeError if one more session (holding `n_bytes`) passes the bounds."""
        if len(self._open) >= self.bounds.max_sessions:
            raise PayloadTooLargeError(
                f"node {self.node_id} already holds {len(self._open)} sessions, its limit; close some first"
            )
        held = sum(s.cache.n_bytes for s in self._open.values())
        if held + n_bytes > self.bounds.max_kv_bytes:
            raise PayloadTooLargeError(
                f"node {self.node_id}: a session of {n_bytes >> 20} MiB KV cache would pass its "
                f"{self.bounds.max_kv_bytes >> 20} MiB for KV caches ({held >> 20} MiB held); lower n_ctx "
                "or wait for sessions to close"
            )

    def fit_kv_caches(self, layout: Layout) -> None:
        """Under an auto budget, the sessions' KV caches (anonymous memory, allocated for their
        whole context) come out of what the layers may keep resident."""
        if layout.auto_budget is None:
            return
        kv = sum(s.cache.n_bytes for s in list(self._open.values()))
        budget = layout.auto_budget - kv
        if budget < layout.windows.largest_layer_bytes:
            raise InputError(
                f"node {self.node_id}: the sessions' KV caches ({kv >> 20} MiB) leave no room for its layers "
                f"in {layout.auto_budget >> 20} MiB; lower --ctx or add a device"
            )
        layout.windows.set_budget(budget)

    def close(self, session_id: str, layout: Layout | None) -> None:
        """Close a session if open, giving its KV cache back to `layout`'s layers."""
        limits.check_session_id(session_id)
        with self._lock:
            session = self._open.pop(session_id, None)
            metrics.NODE_SESSIONS.set(len(self._open))
        if session is not None:
            session.close()
            if layout is not None and session.epoch == layout.plan.epoch:
                self.fit_kv_caches(layout)

    def take_all(self) -> list[NodeSession]:
        """Forget every session, as a new plan does; end them with `end_sessions`."""
        with self._lock:
            taken, self._open = self._open, {}
        return list(taken.values())

    def find(self, session_id: str) -> NodeSession | None:
        return self._open.get(session_id)

    def need(self, session_id: str) -> NodeSession:
        session = self._open.get(session_id)
        if session is None:
            raise UnknownSessionError(
                f"node {self.node_id} has no session {shown(session_id)}; open it first (or it was closed)"
            )
        return session

    def abort(self, session_id: str, node_id: str, message: str) -> None:
        """A node could not pass this session's activations on: end its generation here."""
        limits.check_session_id(session_id)
        session = self._open.get(session_id)
        if session is not None and session.results is not None and not session.aborted:
            session.aborted = True  # the first ends the generation; a flood of them queues nothing
            session.results.put(NodeError(f"node {shown(node_id)}: {message[: limits.MAX_MESSAGE_CHARS]}"))

    def stop_taking_work(self) -> list[str]:
        """From now on refuse new sessions (and plans); the sessions open now run on. Their ids."""
        with self._lock:
            self._stopping = True
            return list(self._open)

    def check_not_stopping(self, what: str) -> None:
        """ShuttingDownError (UNAVAILABLE) once the daemon stops taking work, saying so."""
        if self._stopping:
            raise ShuttingDownError(
                f"node {self.node_id} {SHUTTING_DOWN}: it takes no new {what}; "
                "send it to another node, or plan again without this one"
            )

    def held_kv_bytes(self) -> int:
        """The bytes the open sessions' KV caches hold together."""
        return sum(s.cache.n_bytes for s in list(self._open.values()))


def end_sessions(sessions: list[NodeSession], why: str) -> None:
    """Close sessions taken off a daemon; a head's generation on one fails with `why`."""
    for s in sessions:
        s.close()
        if s.results is not None:
            s.results.put(NodeError(f"session ended: {why}"))
