"""The engine the head daemon runs `generate()` with: embed here, send the hidden states round the
ring hop by hop as the plan orders them, apply the output head when they come back.

Prefill is pipelined: the prompt is cut into micro-batches of `ubatch` tokens and all of them
are injected into the ring before the first result is awaited, so while node 2 computes
micro-batch 1, node 1 already computes micro-batch 2. Each node handles a session's batches in
arrival order, so every layer's KV cache is still written front to back.
"""

from __future__ import annotations

import uuid
from typing import Protocol

import numpy as np

from prima.engine.local import DEFAULT_UBATCH
from prima.errors import ContextFullError, InputError
from prima.model.transformer import Transformer
from prima.net.codec import Activation
from prima.scheduler.plan import Plan


class RingLink(Protocol):
    """The head daemon's side of the ring, as the engine needs it (prima.cluster.daemon)."""

    @property
    def plan(self) -> Plan: ...

    def open_ring_session(self, session_id: str, n_ctx: int) -> None: ...

    def inject(self, act: Activation) -> None: ...

    def receive(self, session_id: str) -> Activation: ...

    def close_ring_session(self, session_id: str) -> None: ...


class RingEngine:
    """`forward(ids) -> last-token logits` over the ring; one instance is one session."""

    def __init__(self, model: Transformer, link: RingLink, n_ctx: int, ubatch: int = DEFAULT_UBATCH) -> None:
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
        self.n_past = 0
        self._seq = 0
        link.open_ring_session(self.session_id, self.n_ctx)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def reset(self) -> None:
        # Nodes need no message: the next batch writes from position 0, which truncates their caches.
        self.n_past = 0

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size == 0:
            raise InputError("nothing to compute: the token list is empty")
        if self.n_past + ids.size > self.n_ctx:
            raise ContextFullError(
                f"{self.n_past + ids.size} tokens do not fit the context of {self.n_ctx}; "
                "shorten the prompt, lower -n, or raise --ctx"
            )
        n_batches = 0
        for s in range(0, ids.size, self.ubatch):
            chunk = ids[s : s + self.ubatch]
            positions = np.arange(self.n_past, self.n_past + chunk.size, dtype=np.int64)
            act = Activation(
                self.session_id, self.plan.epoch, 0, positions, self.model.embed(chunk), self._seq
            )
            self.link.inject(act)
            self._seq += 1
            self.n_past += chunk.size
            n_batches += 1
        last = None
        for _ in range(n_batches):
            last = self.link.receive(self.session_id)
        assert last is not None
        return self.model.output_logits(last.hidden[-1:])[0]

    def close(self) -> None:
        self.link.close_ring_session(self.session_id)
