"""The compute thread of a daemon: each arriving activation goes through this node's windows and
is streamed straight on to the node of its next hop. A window runs as at most two calls: its
`accel_layers` on the accelerator as one compiled model, the rest on the host CPU as one call,
or layer by layer while the node streams weights from disk (prima.forward.placement).

Activations of every session go through one work queue and one thread, so a session's
micro-batches reach each layer in the order they were sent and its KV caches are written front
to back; the queue serves sessions in turn (prima.daemon.fair_queue), so one session's burst
does not hold up the others' steps, and a long micro-batch gives way to other sessions' waiting
work between pieces of its rows within each layer (ROW_PIECE_TOKENS), or between layers where
the backend cannot cut rows (SLICE_MIN_TOKENS). RPC threads only validate and enqueue
(Arrivals.accept), with one exception: a
decode step (or a speculative check of a few tokens) that finds the compute thread idle and
nothing queued is computed in the thread it arrived on, the link's reader or the head's
generation: handing it over would wake the compute thread, a sizeable part of a decode hop
where idle cores halt.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Generator, Iterator
from typing import Protocol

import numpy as np
from prometheus_client import Counter

from prima import metrics
from prima.backends.base import KVState
from prima.errors import NodeError, PrimaError
from prima.forward.placement import Piece
from prima.forward.row_pieces import piece_rows, row_pieces
from prima.forward.windowed_model import WindowedModel
from prima.net.client import Relay
from prima.net.codec import Activation
from prima.net.limits import DaemonLimits, WorkBounds
from prima.plan import Window
from prima.weights.window import StreamStats

from .fair_queue import FairQueue
from .hop_times import HopTimes
from .state import Layout, NodeSession
from .threads import use_threads

log = logging.getLogger("prima.daemon")

# Activations of at most this many tokens may be computed in the thread they arrive on: decode
# steps and speculative checks, which take milliseconds. Prompt micro-batches always queue, so a
# link's reader keeps reading while they compute.
INLINE_MAX_TOKENS = 8

# A micro-batch of more tokens than this is computed one layer at a time, and gives up the
# compute thread between layers while another session has work queued: a decode step of another
# session then waits for one layer of a long batch, not all of them. Layer by layer gives the
# same bits (Backend.windows_bit_identical).
SLICE_MIN_TOKENS = INLINE_MAX_TOKENS
# Within a layer, a micro-batch of at least twice this many rows (rounded to the backend's
# row_piece_unit) is computed in pieces of this many, giving way between pieces: a step then
# waits for one piece, not a whole layer of a flood's --max-batch rows. Pieces are cut where
# they keep the whole batch's bits (prima.forward.row_pieces).
ROW_PIECE_TOKENS = 64
# Pieces that short only while another session is active: it has work queued, or a step of
# some session computed within this long (a generation's next step is coming); otherwise a
# layer's rest runs in one call, since every piece reads the layer's weights again.
ACTIVE_S = 2.0


class WorkerHost(Protocol):
    """What the worker reads from the runtime that owns it: the current plan and sessions."""

    node_id: str
    model: WindowedModel

    @property
    def layout(self) -> Layout | None: ...

    def find_session(self, session_id: str) -> NodeSession | None: ...


class Worker:
    """One compute thread with its queue, and the routing of finished activations."""

    def __init__(
        self, host: WorkerHost, threads: int | None = None, bounds: DaemonLimits | None = None
    ) -> None:
        self.host = host
        self.threads = threads
        # Activations from peers are counted while queued (bounded); those this node routes to
        # itself, from a window it just computed, are not: they already held a place.
        self.queued = WorkBounds(bounds or DaemonLimits())
        self._admitted: set[int] = set()
        self._work: FairQueue[Activation | _Partial] = FairQueue()
        # Activations queued, held or being computed by the compute thread, and whether another
        # thread is computing one inline: a caller computes inline only when both are zero, and
        # the compute thread waits for an inline computation to end, so a session's activations
        # still reach each layer in arrival order, one at a time.
        self._order = threading.Condition()
        self._unfinished = 0
        self._inline = False
        self._caller = threading.local()
        self._relay_lock = threading.Lock()
        # Labelled children of the relayed counter, looked up once per transport, not per hop.
        self._relayed: dict[str, Counter] = {}
        self.hop_times = HopTimes()
        self._step_at = -ACTIVE_S  # when a step (a micro-batch of a few tokens) last computed
        self._thread = threading.Thread(target=self._loop, name="primad-compute", daemon=True)
        self._thread.start()

    def submit(self, act: Activation, layout: Layout, session: NodeSession) -> None:
        """Compute `act`, an activation from a peer checked against `layout` and `session`: here
        if it is small and the compute thread is idle, else queued for it. PayloadTooLargeError
        if the queue bounds are reached. (Computed here, it is not counted: nothing queues.)"""
        if self._compute_here(act, layout, session):
            return
        self.queued.admit(act.session_id, len(act.positions), session.n_ctx)
        self._admitted.add(id(act))
        self._enqueue(act)

    def _enqueue(self, act: Activation) -> None:
        with self._order:
            self._unfinished += 1
        self._work.put(act)

    def _compute_here(self, act: Activation, layout: Layout, session: NodeSession) -> bool:
        """Compute a small activation in the calling thread if the compute thread is idle with
        nothing queued; False (nothing done) otherwise."""
        if len(act.positions) > INLINE_MAX_TOKENS:
            return False
        with self._order:
            if self._unfinished or self._inline:
                return False
            self._inline = True
        try:
            if not getattr(self._caller, "threads_set", False):
                use_threads(self.threads)
                self._caller.threads_set = True
            self._run([act], layout, session)
        finally:
            with self._order:
                self._inline = False
                self._order.notify_all()
        return True

    def _taken(self, act: Activation) -> None:
        if id(act) in self._admitted:
            self._admitted.discard(id(act))
            self.queued.done(act.session_id, len(act.positions))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the batch in hand, then end the thread (bounded wait)."""
        self._work.stop()
        self._thread.join(timeout=timeout_s)

    # -- computing -----------------------------------------------------------------------------
    def _loop(self) -> None:
        use_threads(self.threads)
        pending: collections.deque[Activation | _Partial | None] = collections.deque()
        while True:
            item = pending.popleft() if pending else self._work.get()
            if item is None:
                return
            if isinstance(item, _Partial):
                self._advance(item, pending)
                continue
            act = item
            self._taken(act)
            group = [act]
            layout = self.host.layout
            if layout is not None and layout.windows.limited:
                # Streaming: micro-batches of one prompt waiting at the same hop go through each
                # layer together, so a streamed layer is read once for all of them, not once each.
                while True:
                    try:
                        pending.append(self._work.get_nowait())
                    except queue.Empty:
                        break
                for later in _same_hop_run(pending, act):
                    group.append(later)
                    self._taken(later)
            metrics.NODE_QUEUE_DEPTH.set(self._work.qsize() + len(pending))
            session = self.host.find_session(act.session_id)
            if layout is None or session is None or act.plan_epoch != layout.plan.epoch:
                # The plan changed or the session ended while it queued.
                log.debug("dropping activation of closed session %s", act.session_id)
                self._finished(len(group))
                continue
            steps = self._compute(group, layout, session, sliced=_tokens(group) > SLICE_MIN_TOKENS)
            self._advance(_Partial(act.session_id, layout, session, len(group), steps), pending)

    def _advance(self, part: _Partial, pending: collections.deque[Activation | _Partial | None]) -> None:
        """Compute `part` on, layer after layer, until it is done or another session has work
        waiting; then queue the rest behind that work, ahead of its own session's later batches."""
        with self._order:
            while self._inline:
                self._order.wait()
        if self.host.layout is not part.layout or self.host.find_session(part.session_id) is not part.session:
            log.debug("dropping the rest of a micro-batch of closed session %s", part.session_id)
            part.steps.close()
            self._finished(part.n_items)
            return
        t0 = time.perf_counter()
        done = True
        try:
            for _ in part.steps:
                if self._work.others_waiting(part.session_id) or _others_pending(pending, part.session_id):
                    done = False
                    break
        except PrimaError as exc:
            self.fail(part.session_id, f"node {self.host.node_id}: {exc}", type(exc).__name__)
        except ValueError as exc:  # a cache write with a gap: the session's batches were lost
            self.fail(part.session_id, f"node {self.host.node_id} could not compute: {exc}", "cache_gap")
        part.spent_s += time.perf_counter() - t0
        if done:
            metrics.NODE_COMPUTE.observe(part.spent_s)
            self._finished(part.n_items)
        elif pending:
            # Streaming: the queue is served through `pending`; gather the rest of it there too,
            # so every session waiting, not only those already taken, goes before this one.
            while True:
                try:
                    pending.append(self._work.get_nowait())
                except queue.Empty:
                    break
            _behind_others(pending, part)
        else:
            self._work.put_first(part)

    def _finished(self, n_items: int) -> None:
        with self._order:
            self._unfinished -= n_items

    def _run(self, group: list[Activation], layout: Layout, session: NodeSession) -> None:
        """_compute in one go, timed, with its failures reported to the session's head."""
        act = group[0]
        try:
            t0 = time.perf_counter()
            for _ in self._compute(group, layout, session, sliced=False):
                pass
            metrics.NODE_COMPUTE.observe(time.perf_counter() - t0)
        except PrimaError as exc:
            self.fail(act.session_id, f"node {self.host.node_id}: {exc}", type(exc).__name__)
        except ValueError as exc:  # a cache write with a gap: the session's batches were lost
            self.fail(act.session_id, f"node {self.host.node_id} could not compute: {exc}", "cache_gap")

    def _compute(
        self, group: list[Activation], layout: Layout, session: NodeSession, *, sliced: bool
    ) -> Iterator[None]:
        """Run micro-batches of one session, all at the same hop, through this node's consecutive
        hops, piece by piece (each piece for every micro-batch in order), then route each on.
        `sliced`: the host's layers one at a time, yielding after each, so the caller may let
        other sessions' work run between them; within each layer too, between pieces of rows,
        where the backend keeps the bits (unless streaming, whose reads go layer by layer).

        What the next node does not wait for (the hop timings, debug logs) comes after the
        send: on a ring every step crosses every hop, and a woken core runs each line slowly."""
        act = group[0]
        if _tokens(group) <= SLICE_MIN_TOKENS:
            self._step_at = time.monotonic()
        first = h = act.hop_index
        hidden = [a.hidden for a in group]
        hops = layout.hops
        windows = layout.windows
        model = self.host.model
        cache = session.cache
        per_layer = windows.limited or (sliced and model.host.windows_bit_identical)
        rows = (
            piece_rows(model.host.row_piece_unit, ROW_PIECE_TOKENS)
            if per_layer and not windows.limited
            else 0
        )
        debug = log.isEnabledFor(logging.DEBUG)
        spent_ms: list[float] = []
        while h < len(hops) and hops[h].node_index == layout.me:
            window = hops[h].window
            before = dataclasses.replace(windows.stats) if debug else None
            t0 = time.perf_counter()
            # The accelerator's layers in one call; the host's in one call, or layer by layer
            # while streaming, so compute on one overlaps the prefetch thread reading the next.
            for piece in layout.pieces(range(window.start, window.end), per_layer=per_layer):
                read = not piece.on_accel
                if read:
                    windows.before_layers(piece.layers)
                for i, a in enumerate(group):
                    parts = row_pieces(len(a.positions), 0 if piece.on_accel else rows)
                    if len(parts) == 1:
                        hidden[i] = model.run(piece, hidden[i], a.positions, cache)
                    else:
                        hidden[i] = yield from self._in_pieces(piece, hidden[i], a, cache, parts)
                if read:
                    windows.after_layers(piece.layers)
                if sliced:
                    yield
            spent_ms.append((time.perf_counter() - t0) * 1000)
            if before is not None:
                _log_window(window, group, before, windows.stats)
            h += 1
        for a, out in zip(group, hidden, strict=True):
            # Built directly: dataclasses.replace is slow on a core just woken.
            self.route(
                layout,
                session,
                Activation(a.session_id, a.plan_epoch, h, a.positions, out, a.batch_seq, a.all_rows),
            )
        if all(len(a.positions) == 1 for a in group):
            for hop_index, ms in enumerate(spent_ms, first):
                self.hop_times.add_compute(act.plan_epoch, hop_index, len(group), ms)

    def _in_pieces(
        self, piece: Piece, h: np.ndarray, act: Activation, cache: KVState, parts: list[slice]
    ) -> Generator[None, None, np.ndarray]:
        """`h` of `act` through `piece`, one row piece of `parts` at a time, giving way between
        pieces while another session is active; while none is, the rest of the rows in one call
        (consecutive pieces merged keep the bits too, prima.forward.row_pieces), as a piece
        reads the layer's weights again (3.4x the time of the whole batch in exact mode at 64
        rows, 1.2x in q8)."""
        out = np.empty_like(h)
        j = 0
        while j < len(parts):
            if j:  # the layer's last piece gives way in _compute, with the layer
                yield
            end = j + 1 if self._others_active(act.session_id) else len(parts)
            rows = slice(parts[j].start, parts[end - 1].stop)
            out[rows] = self.host.model.run(piece, h[rows], act.positions[rows], cache)
            j = end
        return out

    def _others_active(self, session_id: str) -> bool:
        """Whether another session has work queued, or any session computed a step lately
        (a generation's next step is then on its way)."""
        recent = time.monotonic() - self._step_at < ACTIVE_S
        return recent or self._work.others_waiting(session_id)

    # -- routing -------------------------------------------------------------------------------
    def route(self, layout: Layout, session: NodeSession, act: Activation) -> None:
        """Send `act` to the node of its hop: computed or queued here if that is this node,
        delivered to the session's results if it has been round the whole ring (on the head)."""
        done = act.hop_index == len(layout.hops)
        dest = 0 if done else layout.hops[act.hop_index].node_index
        if dest == layout.me:
            if done:
                session.hand_back(act, "this node")
            elif not self._compute_here(act, layout, session):
                self._enqueue(act)
            return
        if done and not act.all_rows:
            # Only the last token's hidden state is needed for the logits.
            act = Activation(
                act.session_id,
                act.plan_epoch,
                act.hop_index,
                act.positions[-1:],
                act.hidden[-1:],
                act.batch_seq,
            )
        relay = session.relays.get(dest)
        if relay is None:
            relay = self._open_relay(layout, session, dest)
        try:
            t0 = time.perf_counter()
            relay.send(act)
            sent_s = time.perf_counter() - t0
        except NodeError as exc:
            self.fail(session.session_id, str(exc), "relay")
            return
        metrics.NODE_RELAY_SEND.observe(sent_s)
        relayed = self._relayed.get(relay.transport)
        if relayed is None:
            relayed = self._relayed[relay.transport] = metrics.NODE_RELAYED.labels(relay.transport)
        relayed.inc()
        if len(act.positions) == 1 and act.hop_index > 0:
            # A decode step's output of the hop before `hop_index` (the next to compute): timed.
            self.hop_times.add_relay(act.plan_epoch, act.hop_index - 1, sent_s * 1000)

    def _open_relay(self, layout: Layout, session: NodeSession, dest: int) -> Relay:
        """The session's relay to node `dest`, opened on its first activation there."""
        with self._relay_lock:
            relay = session.relays.get(dest)
            if relay is None:
                sid = session.session_id
                relay = layout.clients[dest].relay(
                    lambda err: self.fail(sid, str(err), "relay"), layout.wire_dtype
                )
                session.relays[dest] = relay
            return relay

    def fail(self, session_id: str, message: str, kind: str = "other") -> None:
        """Tell the head that a session cannot go on (or, on the head, wake its generation)."""
        log.warning("session %s failed: %s", session_id, message)
        metrics.NODE_ERRORS.labels(kind).inc()
        layout = self.host.layout
        session = self.host.find_session(session_id)
        if session is not None and session.results is not None:
            session.results.put(NodeError(message))
        elif layout is not None and not layout.is_head:
            try:
                layout.clients[0].abort(session_id, self.host.node_id, message)
            except NodeError as exc:
                log.warning("could not tell the head about it: %s", exc)


@dataclasses.dataclass
class _Partial:
    """A session's micro-batches part-way through this node's layers, waiting for their turn:
    the rest of their computation (`steps`) and the plan and session it was started under."""

    session_id: str
    layout: Layout
    session: NodeSession
    n_items: int
    steps: Iterator[None]
    spent_s: float = 0.0  # computing so far, its waits for other sessions' turns left out


def _tokens(group: list[Activation]) -> int:
    return sum(len(a.positions) for a in group)


def _others_pending(pending: collections.deque[Activation | _Partial | None], session_id: str) -> bool:
    return any(item is not None and item.session_id != session_id for item in pending)


def _behind_others(pending: collections.deque[Activation | _Partial | None], part: _Partial) -> None:
    """Put `part` in `pending` after every other session's items and before its own session's
    (whose order is kept): the others take their turn before it computes on."""
    own = [item for item in pending if item is not None and item.session_id == part.session_id]
    others = [item for item in pending if item is None or item.session_id != part.session_id]
    pending.clear()
    pending.extend([*others, part, *own])


def _log_window(window: Window, group: list[Activation], before: StreamStats, now: StreamStats) -> None:
    log.debug(
        "window %s (%d tokens): compute %.1f ms, waited %.1f ms for reads; prefetch read %.1f MiB in %.1f ms",
        window,
        sum(len(a.positions) for a in group),
        now.compute_ms - before.compute_ms,
        now.wait_ms - before.wait_ms,
        (now.bytes_read - before.bytes_read) / (1 << 20),
        now.read_ms - before.read_ms,
    )


def _same_hop_run(
    pending: collections.deque[Activation | _Partial | None], act: Activation
) -> list[Activation]:
    """Take from `pending` the micro-batches of `act`'s session that follow it at the same hop,
    up to the first of that session at another hop or part-way computed (its order is kept);
    other sessions' stay."""
    taken: list[Activation] = []
    kept: collections.deque[Activation | _Partial | None] = collections.deque()
    blocked = False
    for item in pending:
        if not blocked and item is not None and item.session_id == act.session_id:
            if not isinstance(item, _Partial) and _same_hop(item, act):
                taken.append(item)
                continue
            blocked = True
        kept.append(item)
    pending.clear()
    pending.extend(kept)
    return taken


def _same_hop(a: Activation, b: Activation) -> bool:
    return (a.session_id, a.plan_epoch, a.hop_index) == (b.session_id, b.plan_epoch, b.hop_index)
