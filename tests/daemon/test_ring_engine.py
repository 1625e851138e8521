"""RingEngine without processes: prefill micro-batches all enter the ring before the first result
is awaited (pipelined), positions follow each other, and logits come from the last row; tokens
replayed as decoded go in micro-batches no larger than the backend keeps bit-identical rows."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from prima.daemon.head import RingEngine
from prima.net.codec import Activation
from prima.plan import Plan, plan_from_window_sizes


@dataclass
class _Config:
    context_length: int = 128
    vocab_size: int = 5


@dataclass
class _Backend:
    batch_identical_tokens: int = 2


class _Model:
    config = _Config()
    backend = _Backend()

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return np.repeat(ids[:, None].astype(np.float32), 3, axis=1)

    def output_logits(self, h: np.ndarray) -> np.ndarray:
        return np.tile(h[:, :1], (1, self.config.vocab_size))


class _Link:
    """Records the order of sends and receives; the 'ring' returns each batch unchanged."""

    def __init__(self) -> None:
        self.plan: Plan = plan_from_window_sizes([("a", "x:1"), ("b", "x:2")], [2, 2], 1, 4)
        self.events: list[tuple[str, int]] = []
        self.in_flight: list[Activation] = []

    def open_ring_session(self, session_id: str, n_ctx: int) -> None:
        self.events.append(("open", n_ctx))

    def inject(self, act: Activation) -> None:
        self.events.append(("send", int(act.positions[0])))
        self.in_flight.append(act)

    def receive(self, session_id: str) -> Activation:
        act = self.in_flight.pop(0)
        self.events.append(("recv", int(act.positions[0])))
        return replace(act, hop_index=len(self.plan.hops()))

    def close_ring_session(self, session_id: str) -> None:
        self.events.append(("close", 0))


def test_prefill_micro_batches_are_pipelined() -> None:
    link = _Link()
    engine = RingEngine(_Model(), link, n_ctx=64, ubatch=3)  # type: ignore[arg-type]
    logits = engine.forward([4, 3, 2, 1, 0, 2, 1, 3])
    kinds = [k for k, _ in link.events[1:]]
    assert kinds == ["send"] * 3 + ["recv"] * 3  # nothing awaited before every batch was sent
    assert [p for k, p in link.events if k == "send"] == [0, 3, 6]
    assert logits[0] == 3.0  # the last token's row
    engine.forward([1])
    assert link.events[-2] == ("send", 8)
    engine.reset()
    engine.forward([2])
    assert link.events[-2] == ("send", 0)
    engine.close()
    assert link.events[-1] == ("close", 0)


def test_replayed_tokens_go_in_decode_sized_micro_batches() -> None:
    link = _Link()
    engine = RingEngine(_Model(), link, n_ctx=64, ubatch=8)  # type: ignore[arg-type]
    engine.forward([4, 3, 2])
    logits = engine.forward_decoded([1, 0, 2, 3, 1])
    sends = [(k, p) for k, p in link.events if k != "open"][2:]
    # Batches of 2 (the backend's batch_identical_tokens), every one sent before any is awaited.
    assert sends == [("send", 3), ("send", 5), ("send", 7), ("recv", 3), ("recv", 5), ("recv", 7)]
    assert logits[0] == 1.0  # the last token's row
    assert engine.n_past == 8
