"""Continuous batching on this device: the decode steps of every generation waiting for the
model go through it in one pass, so the weights are read once per step for all of them.

Each generation runs in its own thread and samples its own tokens. A decode step is put on a
shared list, then its thread waits for its turn (TurnTaking, first come first served). Whoever
gets a turn runs every step on the list at that moment as one batch (LocalEngine caches, one
row each) and hands each thread its logits; a thread whose step an earlier turn already ran
returns at once. Prompts still run one per turn, between batches. Attention is the only per-
session part of a block (prima.backends.reference.block_sessions), and a pass carries at most
`WindowedModel.decode_batch_rows` steps (the CPU's fused per-row kernels take up to 4 rows; more
would go through the int8 GEMM or BLAS in another summation order), so each session's logits
have exactly the bits it would get alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from prima.backends.base import KVState
from prima.engine.generate import forward_ids
from prima.engine.turns import TurnTaking
from prima.forward.windowed_model import WindowedModel


class BatchedEngine(Protocol):
    """What the batcher uses of a session's engine (prima.engine.local.LocalEngine, which builds
    the batcher): its model and KV cache, where it stands, its own one-token pass, and counting
    the token a batched pass wrote to its cache."""

    model: WindowedModel
    cache: KVState
    n_ctx: int

    @property
    def n_past(self) -> int: ...

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray: ...

    def count_written(self, token_ids: np.ndarray) -> None: ...


@dataclass
class _Step:
    engine: BatchedEngine
    token: int
    done: threading.Event = field(default_factory=threading.Event)
    logits: np.ndarray | None = None
    error: BaseException | None = None


class DecodeBatcher:
    """Runs the decode steps of LocalEngines sharing one model, batched (see the module doc).
    `batch_sizes` records how many sessions each pass carried (for tests and metrics)."""

    def __init__(self, turns: TurnTaking) -> None:
        self.turns = turns
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()
        self._pending: list[_Step] = []

    def step(self, engine: BatchedEngine, token: int) -> np.ndarray:
        """The logits after `token` on `engine`: run in whichever batch takes it first."""
        forward_ids([token], engine.n_past, engine.n_ctx)  # a full context fails in its own thread
        step = _Step(engine, int(token))
        with self._lock:
            self._pending.append(step)
        with self.turns.turn():
            if not step.done.is_set():
                with self._lock:
                    batch, self._pending = self._pending, []
                self._run(batch)
        if step.error is not None:
            raise step.error
        assert step.logits is not None
        return step.logits

    def _run(self, steps: list[_Step]) -> None:
        """Every step of `steps`, in passes of as many as the model computes exactly as alone."""
        rows = steps[0].engine.model.decode_batch_rows
        for start in range(0, len(steps), rows):
            self._pass(steps[start : start + rows])

    def _pass(self, batch: list[_Step]) -> None:
        """One pass over the model for every step of `batch`; each step gets its logits or the error."""
        try:
            if len(batch) == 1:  # alone: the engine's own decode path (the fused one-call block)
                batch[0].logits = batch[0].engine.forward([batch[0].token])
                self.batch_sizes.append(1)
                return
            model = batch[0].engine.model
            positions = np.array([s.engine.n_past for s in batch], dtype=np.int64)
            h = model.embed(np.array([s.token for s in batch], dtype=np.int64))
            sessions = [(s.engine.cache, 1) for s in batch]
            h = model.forward_sessions(h, positions, 0, model.config.n_layers, sessions)
            logits = model.output_logits(h)
            self.batch_sizes.append(len(batch))
            for i, s in enumerate(batch):
                s.engine.count_written(np.array([s.token]))
                s.logits = logits[i]
        except Exception as exc:  # every waiting generation hears of it, in its own thread
            for s in batch:
                s.error = exc
        finally:
            for s in batch:
                s.done.set()
