"""Generation on the ring, on its head (node 0 of the plan): embed here, send the hidden states
round the ring hop by hop, apply the output head when they come back, sample here. Only token
ids go back to the coordinator.

Prefill is pipelined: the prompt is cut into micro-batches of `ubatch` tokens and all of them
are injected into the ring before the first result is awaited, so while node 2 computes
micro-batch 1, node 1 already computes micro-batch 2. Each node handles a session's batches in
arrival order, so every layer's KV cache is still written front to back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Generator
from typing import Protocol

import numpy as np

from prima.engine.draft_model import DraftModel
from prima.engine.generate import GenerateRequest, GenerationDone, TokenEvent, forward_ids, sample_tokens
from prima.engine.local import DEFAULT_UBATCH
from prima.errors import GenerationCancelled, InputError, NodeError, ProtocolError
from prima.forward.windowed_model import WindowedModel
from prima.net.codec import Activation
from prima.net.liveness import Liveness, probe_nodes, wait_for
from prima.net.run_ahead import stop_requested, waiting
from prima.net.status import NotReadyError, PayloadTooLargeError, UnknownSessionError
from prima.plan import Plan

from .kept_sessions import DEFAULT_IDLE_S, KeptSessions
from .state import Layout, NodeSession, OwnHop
from .threads import use_threads
from .worker import Worker

log = logging.getLogger("prima.daemon")

# How long the head waits for the ring before it hands the tokens sampled so far to the
# coordinator's stream: by then the next node has woken and computes. Handed over at once, the
# write would wake the Generate handler and the coordinator just as that node wakes, and the
# three would contend for the cores.
HAND_OVER_AFTER_S = 0.001
CANCEL_POLL_S = 0.1  # how often a head waiting for the ring checks that its caller is still there


class RingLink(Protocol):
    """The head's side of the ring, as RingEngine needs it (Head below)."""

    @property
    def plan(self) -> Plan: ...

    def open_ring_session(self, session_id: str, n_ctx: int) -> None: ...

    def inject(self, act: Activation) -> None: ...

    def receive(self, session_id: str) -> Activation: ...

    def close_ring_session(self, session_id: str) -> None: ...


class RingEngine:
    """`forward(ids) -> last-token logits` over the ring; one instance is one session. Like
    LocalEngine it says which tokens the ring's caches hold (`held_tokens`), so a kept session
    (prima.daemon.kept_sessions) can serve the next request that starts with them."""

    def __init__(
        self, model: WindowedModel, link: RingLink, n_ctx: int, ubatch: int = DEFAULT_UBATCH
    ) -> None:
        if n_ctx <= 0:
            raise InputError(f"context size must be positive, got {n_ctx}")
        if ubatch <= 0:
            raise InputError(f"micro-batch size must be positive, got {ubatch}")
        self.model = model
        self.link = link
        self.plan = link.plan
        self.n_ctx = min(n_ctx, model.config.context_length)
        self.ubatch = ubatch
        self.session_id = uuid.uuid4().hex
        self._held: list[int] = []  # the token at each position the nodes' caches hold
        self._seq = 0
        link.open_ring_session(self.session_id, self.n_ctx)

    @property
    def checks_over_network(self) -> bool:
        """Whether a check of drafts waits for other nodes (a ring of two or more), while the
        drafter can guess on (prima.engine.drafts_ahead); a ring of one computes it here."""
        return len(self.plan.nodes) > 1

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def n_past(self) -> int:
        return len(self._held)

    @property
    def held_tokens(self) -> tuple[int, ...]:
        return tuple(self._held)

    def reset(self) -> None:
        # Nodes need no message: the next batch writes from position 0, which truncates their caches.
        self._held.clear()

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        last = self._round_trip(token_ids, self.ubatch, all_rows=False)[-1]
        return self.model.output_logits(last.hidden[-1:])[0]

    def forward_all(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Logits (n, vocab) of every token, in one trip round the ring for a few tokens: the
        micro-batches are as small as keeps each row what `forward` gives the token alone."""
        batch = self.model.backend.batch_identical_tokens
        acts = self._round_trip(token_ids, batch, all_rows=True)
        return np.concatenate([self.model.output_logits(a.hidden) for a in acts])

    def forward_decoded(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """The last token's logits, the tokens sent round the ring as decoding sends them, a few
        per micro-batch, the micro-batches pipelined (replaying a resumed generation's tokens)."""
        batch = self.model.backend.batch_identical_tokens
        last = self._round_trip(token_ids, batch, all_rows=False)[-1]
        return self.model.output_logits(last.hidden[-1:])[0]

    def hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        ids = forward_ids(token_ids, self.n_past, self.n_ctx)
        back = self._round_trip(ids, self.ubatch, all_rows=True)
        rows = sum(len(a.positions) for a in back)
        if rows != ids.size:
            raise ProtocolError(
                f"the ring returned {rows} hidden rows for {ids.size} tokens; "
                "a node runs an older primad: update every node"
            )
        return self.model.output_norm(np.concatenate([a.hidden for a in back]))

    def rewind(self, n_past: int) -> None:
        """Forget positions from `n_past` on: the next batch writes there, which truncates every
        node's cache (positions travel with the activations)."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot rewind to {n_past}: the ring holds {self.n_past} positions")
        del self._held[n_past:]

    def _round_trip(
        self, token_ids: list[int] | np.ndarray, ubatch: int, *, all_rows: bool
    ) -> list[Activation]:
        """Inject the tokens in micro-batches of `ubatch` (pipelined round the ring) and wait
        for each to come back."""
        ids = forward_ids(token_ids, self.n_past, self.n_ctx)
        n_batches = 0
        for s in range(0, ids.size, ubatch):
            _raise_if_stopped(self.session_id)  # a micro-batch the head computes itself runs here
            chunk = ids[s : s + ubatch]
            positions = np.arange(self.n_past, self.n_past + chunk.size, dtype=np.int64)
            hidden = self.model.embed(chunk)
            self.link.inject(
                Activation(self.session_id, self.plan.epoch, 0, positions, hidden, self._seq, all_rows)
            )
            self._seq += 1
            self._held.extend(int(t) for t in chunk)
            n_batches += 1
        return [self.link.receive(self.session_id) for _ in range(n_batches)]

    def close(self) -> None:
        self.link.close_ring_session(self.session_id)


class HeadHost(Protocol):
    """What the head reads from the runtime that owns it."""

    node_id: str
    model: WindowedModel

    def need_layout(self) -> Layout: ...

    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None: ...

    def close_session(self, session_id: str) -> None: ...

    def need_session(self, session_id: str) -> NodeSession: ...


class Head:
    """The head node's ring sessions (a RingLink) and the generations run on them; `worker`
    computes and routes this node's hops; `draft_model` (primad --draft-model) drafts for
    generations that ask for `--draft model`. Up to `keep_sessions` sessions stay open after
    their generation, for `session_idle_s` unused (prima.daemon.kept_sessions)."""

    def __init__(
        self,
        host: HeadHost,
        worker: Worker,
        ring_timeout_s: float,
        threads: int | None = None,
        liveness: Liveness | None = None,
        draft_model: DraftModel | None = None,
        keep_sessions: int = 0,
        session_idle_s: float = DEFAULT_IDLE_S,
    ) -> None:
        self.host = host
        self.worker = worker
        # Ring sessions kept open between requests (primad --keep-sessions).
        self.kept: KeptSessions[RingEngine] = KeptSessions(keep_sessions, lambda e: e.close(), session_idle_s)
        self.threads = threads
        self.draft_model = draft_model
        # A hung or vanished node is named within seconds; ring_timeout_s only bounds a ring
        # whose nodes all answer but whose activations never come back.
        self.liveness = liveness or Liveness(give_up_s=ring_timeout_s)

    @property
    def plan(self) -> Plan:
        return self.host.need_layout().plan

    def generate(self, request: GenerateRequest) -> Generator[TokenEvent, None, None]:
        """Token ids as sampled here, then a GenerationDone; runs in the caller's thread, and
        closing the iterator ends the generation (its ring session is kept for the next request
        when it ended well and sessions are kept, else closed).

        A kept session whose prompt prefix fails before the first token (a node lost it) is
        closed and the request runs again on a new session, its whole prompt computed."""
        use_threads(self.threads)  # each call may come on another gRPC thread
        self._check_draft_model(request)
        n_ctx = min(request.n_ctx, self.host.model.config.context_length)
        engine = self.kept.take(request.prompt_ids, self.plan.epoch, n_ctx)
        if engine is not None:
            engine.ubatch = request.ubatch or DEFAULT_UBATCH
            events = self._run(engine, request)
            try:
                first = next(events)
            except (NodeError, UnknownSessionError) as exc:
                log.info(
                    "kept session %s failed (%s): the prompt runs whole on a new one", engine.session_id, exc
                )
            else:
                try:
                    yield first
                    yield from events
                finally:
                    events.close()
                return
        yield from self._run(self._open_engine(request), request)

    def _open_engine(self, request: GenerateRequest) -> RingEngine:
        """A new ring session for `request`; if some node has no room for it, the kept sessions
        are closed and it is opened again."""
        ubatch = request.ubatch or DEFAULT_UBATCH
        try:
            return RingEngine(self.host.model, self, request.n_ctx, ubatch)
        except (NodeError, PayloadTooLargeError):
            if not self.kept.release_all():
                raise
        return RingEngine(self.host.model, self, request.n_ctx, ubatch)

    def _run(self, engine: RingEngine, request: GenerateRequest) -> Generator[TokenEvent, None, None]:
        closed = False
        try:
            for event in sample_tokens(engine, request, draft_model=self.draft_model):
                if isinstance(event, GenerationDone):
                    # Free (or keep) the session before the coordinator hears the end: it may
                    # hang up then.
                    if request.keep_session:
                        self.kept.keep(engine)
                    else:
                        engine.close()
                    closed = True
                yield event
        finally:
            if not closed:
                # Failed or cancelled: a hung peer's CloseSession must not hold up the error on
                # its way to the coordinator, so the peers are told from another thread.
                self.host.close_session(engine.session_id)
                threading.Thread(
                    target=self.close_ring_session,
                    args=(engine.session_id,),
                    name="primad-close",
                    daemon=True,
                ).start()

    def _check_draft_model(self, request: GenerateRequest) -> None:
        """InputError before any ring session opens when the request's draft model is not the
        one this head has."""
        if request.draft.method != "model":
            return
        node = self.host.node_id
        if self.draft_model is None:
            raise InputError(
                f"node {node} (the ring's head) has no draft model: start its primad with "
                "--draft-model PATH_OR_NAME, or use --draft lookup"
            )
        expected = request.draft.model_fingerprint
        if expected and expected != self.draft_model.fingerprint:
            raise InputError(
                f"node {node} (the ring's head) drafts with {self.draft_model.name} "
                f"({self.draft_model.loaded.path}, fingerprint {self.draft_model.fingerprint[:12]}), "
                f"not the draft model asked for (fingerprint {expected[:12]}): start its primad with "
                "--draft-model of the same file, or omit --draft-model to use its own"
            )

    # -- RingLink ------------------------------------------------------------------------------
    def open_ring_session(self, session_id: str, n_ctx: int) -> None:
        """Open the session here (collecting results) and on every other node of the plan."""
        layout = self.host.need_layout()
        if not layout.is_head:
            raise NotReadyError(
                f"node {self.host.node_id} is not the head of the plan; send this to {layout.plan.head.address}"
            )
        self.host.open_session(session_id, layout.plan.epoch, n_ctx)
        self.host.need_session(session_id).results = queue.SimpleQueue()
        try:
            for client in layout.clients.values():
                client.open_session(session_id, layout.plan.epoch, n_ctx)
        except NodeError:
            self.close_ring_session(session_id)
            raise

    def inject(self, act: Activation) -> None:
        """Send a freshly embedded micro-batch into the ring."""
        session = self.host.need_session(act.session_id)
        session.in_flight += 1  # before it leaves: it may be back before `route` returns
        self.worker.route(self.host.need_layout(), session, act)

    def receive(self, session_id: str) -> Activation:
        """The next micro-batch back from the ring; NodeError if a node failed, or went quiet
        and stopped answering probes (prima.net.liveness).

        A decode step that reaches one of this node's own hops comes here too, as an OwnHop
        (Arrivals.accept), and is computed in this thread, which waits for it anyway."""
        session = self.host.need_session(session_id)
        results = session.results
        assert results is not None, "opened by open_ring_session"
        item: Activation | OwnHop | NodeError | None
        try:
            item = results.get(timeout=HAND_OVER_AFTER_S)
        except queue.Empty:
            item = None
        waiting()  # tokens sampled so far go to the coordinator while this thread waits
        while True:
            _raise_if_stopped(session_id)
            layout = self.host.need_layout()
            if item is None:
                try:  # the step this thread just computed may have ended the trip round the ring
                    item = results.get_nowait()
                except queue.Empty:
                    pass
            if item is None:
                peers = list(layout.clients.values())
                item = wait_for(
                    lambda timeout_s: _get_unless_stopped(results, timeout_s, session_id),
                    lambda timeout_s, peers=peers: probe_nodes(peers, timeout_s),
                    self.liveness.for_token_time(layout.plan.predicted_ms_per_token),
                    what=f"session {session_id}",
                )
            if isinstance(item, NodeError):
                raise item
            if isinstance(item, OwnHop):
                self.worker.route(layout, session, item.act)  # computed here, then sent on
                item = None
                continue
            session.in_flight -= 1  # an Activation here has been round the whole ring
            return item

    def close_ring_session(self, session_id: str) -> None:
        self.host.close_session(session_id)
        try:
            layout = self.host.need_layout()
        except NotReadyError:
            return
        for client in layout.clients.values():
            try:
                client.close_session(session_id)
            except NodeError as exc:
                log.info("closing session %s: %s", session_id, exc)


def _raise_if_stopped(session_id: str) -> None:
    """GenerationCancelled once the caller of this generation went away (prima.net.run_ahead):
    a prefill stops within a micro-batch, not at its first token."""
    if stop_requested():
        raise GenerationCancelled(f"session {session_id}: the caller went away")


def _get_unless_stopped(results: queue.Queue, timeout_s: float, session_id: str) -> object:
    """`results.get(timeout=timeout_s)` in slices of CANCEL_POLL_S, checking between them whether
    the generation was called off."""
    deadline = time.monotonic() + timeout_s
    while True:
        _raise_if_stopped(session_id)
        left = deadline - time.monotonic()
        if left <= 0:
            raise queue.Empty
        try:
            return results.get(timeout=min(left, CANCEL_POLL_S))
        except queue.Empty:
            continue
