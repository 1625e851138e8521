"""The compute thread (prima.daemon.worker) on a one-node plan: a prompt's micro-batch queues
for the compute thread and a decode step is computed where it arrives, both giving one pass's
hidden states and ending in the head's results; the queue's bounds refuse a flood; a failure
wakes the head's generation."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.daemon.worker import INLINE_MAX_TOKENS, ROW_PIECE_TOKENS
from prima.engine.local import LocalEngine
from prima.errors import NodeError
from prima.forward.loader import LoadedModel
from prima.forward.row_pieces import piece_rows
from prima.net.codec import Activation, WireDType
from prima.net.limits import DaemonLimits
from prima.net.status import PayloadTooLargeError
from tests.daemon.conftest import N_LAYERS, embedded, solo_plan

WAIT_S = 60.0  # for the compute thread to hand a result back, not a timing


def _results(runtime: NodeRuntime, session_id: str, n_ctx: int = 32) -> queue.SimpleQueue[object]:
    """A head-side session waiting for one micro-batch."""
    runtime.open_session(session_id, runtime.plan.epoch, n_ctx)
    session = runtime.need_session(session_id)
    results: queue.SimpleQueue[object] = queue.SimpleQueue()
    session.results = results  # type: ignore[assignment]
    session.in_flight = 1
    return results


def _one_pass_logits(runtime: NodeRuntime, ids: list[int]) -> np.ndarray:
    return LocalEngine(runtime.model, n_ctx=32).forward(ids)


@pytest.mark.parametrize("n_tokens", [1, INLINE_MAX_TOKENS + 4])
def test_a_micro_batch_goes_through_every_layer_and_back(solo_runtime: NodeRuntime, n_tokens: int) -> None:
    """A decode step computes inline; a prompt's micro-batch on the compute thread."""
    results = _results(solo_runtime, "s")
    ids = list(range(3, 3 + n_tokens))
    layout = solo_runtime.need_layout()
    solo_runtime.worker.submit(embedded(solo_runtime, "s", ids), layout, solo_runtime.need_session("s"))
    back = results.get(timeout=WAIT_S)
    assert isinstance(back, Activation)
    assert back.hop_index == len(layout.hops)
    assert back.hidden.shape[0] == n_tokens
    logits = solo_runtime.model.output_logits(back.hidden[-1:])[0]
    np.testing.assert_array_equal(logits, _one_pass_logits(solo_runtime, ids))


class _Arrivals(queue.SimpleQueue):  # type: ignore[type-arg]
    """A head's results queue that also notes, in one list shared by sessions, who came back."""

    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order = name, order

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        self.order.append(self.name)
        super().put(item, block, timeout)


@pytest.fixture(params=["resident", "streaming"])
def either_runtime(request: pytest.FixtureRequest, tiny_daemon_model: LoadedModel) -> Iterator[NodeRuntime]:
    """A solo daemon holding its layers, or streaming them from disk under a budget of half of
    them (its compute thread then groups each session's batches at a hop)."""
    layer_bytes = sum(t.n_bytes for t in tiny_daemon_model.gguf.tensors.values() if t.name.startswith("blk."))
    budget = 0 if request.param == "resident" else layer_bytes // 2  # two of its four layers
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=budget, threads=1)
    runtime.load_plan(solo_plan(), "solo", WireDType.F32)
    assert runtime.need_layout().windows.limited == (request.param == "streaming")
    yield runtime
    runtime.shutdown()


def test_a_long_micro_batch_lets_another_sessions_step_through_between_its_layers(
    either_runtime: NodeRuntime,
) -> None:
    """A member's long batch gives up the compute thread after each layer while another session
    waits; computed layer by layer, its rows keep the bits of the whole window in one call."""
    solo_runtime = either_runtime
    order: list[str] = []
    for name in ("flood", "chat"):
        _results(solo_runtime, name)
        solo_runtime.need_session(name).results = _Arrivals(name, order)  # type: ignore[assignment]
    flood_ids = list(range(3, 3 + 30))
    layout = solo_runtime.need_layout()
    worker = solo_runtime.worker
    with worker._order:  # the compute thread stops before its first layer until both have queued
        worker.submit(embedded(solo_runtime, "flood", flood_ids), layout, solo_runtime.need_session("flood"))
        worker.submit(embedded(solo_runtime, "chat", [5]), layout, solo_runtime.need_session("chat"))
    flood = solo_runtime.need_session("flood").results.get(timeout=WAIT_S)  # type: ignore[union-attr]
    chat = solo_runtime.need_session("chat").results.get(timeout=WAIT_S)  # type: ignore[union-attr]
    assert order == ["chat", "flood"]  # the step did not wait for the flood's four layers
    assert isinstance(flood, Activation)
    assert isinstance(chat, Activation)
    model = solo_runtime.model
    whole = model.forward_layers(
        model.embed(np.asarray(flood_ids)), np.arange(30), 0, N_LAYERS, model.new_cache(32)
    )
    np.testing.assert_array_equal(flood.hidden, whole)
    np.testing.assert_array_equal(
        model.output_logits(chat.hidden[-1:])[0], _one_pass_logits(solo_runtime, [5])
    )


class _Noting(queue.SimpleQueue):  # type: ignore[type-arg]
    """A head's results queue that notes, as its step comes back, how many of another session's
    positions layer 0 of this node holds."""

    def __init__(self, runtime: NodeRuntime, other: str) -> None:
        super().__init__()
        self.runtime, self.other = runtime, other
        self.layer0: list[int] = []

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        self.layer0.append(self.runtime.need_session(self.other).cache.host.length(0))  # type: ignore[union-attr]
        super().put(item, block, timeout)


def test_a_long_micro_batch_lets_another_sessions_step_through_between_pieces_of_a_layer(
    solo_runtime: NodeRuntime,
) -> None:
    """A long batch gives way within a layer, between pieces of its rows: the other session's
    step comes back while the batch's first layer holds one piece's keys, not the whole batch;
    computed in pieces, the batch's rows keep the bits of the whole window in one call."""
    rows = piece_rows(solo_runtime.model.host.row_piece_unit, ROW_PIECE_TOKENS)
    n = 2 * rows + rows // 2  # three pieces, the last one and a half pieces long
    flood_ids = [3 + i % 100 for i in range(n)]
    flood_results = _results(solo_runtime, "flood", n)
    _results(solo_runtime, "chat")
    noting = _Noting(solo_runtime, "flood")
    solo_runtime.need_session("chat").results = noting  # type: ignore[assignment]
    layout = solo_runtime.need_layout()
    worker = solo_runtime.worker
    with worker._order:  # the compute thread stops before its first piece until both have queued
        worker.submit(embedded(solo_runtime, "flood", flood_ids), layout, solo_runtime.need_session("flood"))
        worker.submit(embedded(solo_runtime, "chat", [5]), layout, solo_runtime.need_session("chat"))
    flood = flood_results.get(timeout=WAIT_S)
    chat = noting.get(timeout=WAIT_S)
    assert noting.layer0 == [rows]  # the step waited for one piece of layer 0, not for n rows
    assert isinstance(flood, Activation)
    assert isinstance(chat, Activation)
    model = solo_runtime.model
    whole = model.forward_layers(
        model.embed(np.asarray(flood_ids)), np.arange(n), 0, N_LAYERS, model.new_cache(n)
    )
    np.testing.assert_array_equal(flood.hidden, whole)
    np.testing.assert_array_equal(
        model.output_logits(chat.hidden[-1:])[0], _one_pass_logits(solo_runtime, [5])
    )


def test_decode_steps_are_timed_per_hop(solo_runtime: NodeRuntime) -> None:
    results = _results(solo_runtime, "s")
    layout = solo_runtime.need_layout()
    solo_runtime.worker.submit(embedded(solo_runtime, "s", [3]), layout, solo_runtime.need_session("s"))
    results.get(timeout=WAIT_S)
    (hop,) = solo_runtime.worker.hop_times.snapshot(layout.plan.epoch)
    assert (hop.hop_index, hop.steps) == (0, 1)


@pytest.fixture
def bounded(tiny_daemon_model: LoadedModel) -> Iterator[NodeRuntime]:
    """A daemon whose compute queue holds at most 12 tokens."""
    runtime = NodeRuntime(
        tiny_daemon_model, "solo", budget_bytes=0, threads=1, bounds=DaemonLimits(max_queued_tokens=12)
    )
    runtime.load_plan(solo_plan(), "solo", WireDType.F32)
    yield runtime
    runtime.shutdown()


def test_a_flood_past_the_queue_bound_is_refused(bounded: NodeRuntime) -> None:
    _results(bounded, "s")
    act = embedded(bounded, "s", list(range(3, 19)))  # 16 tokens: queued, never inline
    with pytest.raises(PayloadTooLargeError, match="tokens of activations are already queued"):
        bounded.worker.submit(act, bounded.need_layout(), bounded.need_session("s"))


def test_a_failure_wakes_the_heads_generation(solo_runtime: NodeRuntime) -> None:
    results = _results(solo_runtime, "s")
    solo_runtime.worker.fail("s", "node peer: gone", kind="relay")
    error = results.get_nowait()
    assert isinstance(error, NodeError)
    assert str(error) == "node peer: gone"
