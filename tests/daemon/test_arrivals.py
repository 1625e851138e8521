"""Activations arriving from peers (prima.daemon.arrivals): refused when not of this node's plan,
hop or session context; on the head, a result back from the ring and a decode step at its own
hop go to its generation, a prompt micro-batch to the compute thread."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterator

import numpy as np
import pytest

from prima.daemon.arrivals import Arrivals, check_epoch, check_hop
from prima.daemon.install import build_layout
from prima.daemon.runtime import NodeRuntime
from prima.daemon.state import Layout, OwnHop
from prima.daemon.worker import INLINE_MAX_TOKENS
from prima.errors import ProtocolError
from prima.forward.loader import LoadedModel
from prima.net.codec import Activation, WireDType
from prima.net.status import NotReadyError, StaleEpochError, UnknownSessionError
from tests.daemon.conftest import embedded, pair_plan

RESULT_WAIT_S = 60.0  # bound on the wait for the compute thread's result


@pytest.fixture
def follower(tiny_daemon_model: LoadedModel) -> Iterator[Layout]:
    """Node 1 of the pair plan: hop 0 (layers 0-1) is its, hop 1 the head's."""
    layout, _ = build_layout(
        tiny_daemon_model, pair_plan(), 1, WireDType.F32, node_id="solo", budget_bytes=0, identity=None
    )
    yield layout
    layout.close()


def _act(hop_index: int, positions: list[int], epoch: int = 1) -> Activation:
    return Activation("s", epoch, hop_index, np.asarray(positions), np.zeros((len(positions), 8), np.float32))


def test_an_activation_of_another_epoch_is_stale(follower: Layout) -> None:
    check_epoch(_act(0, [0]), follower, "solo")
    with pytest.raises(StaleEpochError, match="activation for plan epoch 2 but node solo runs epoch 1"):
        check_epoch(_act(0, [0], epoch=2), follower, "solo")


def test_a_follower_takes_only_its_own_hops(follower: Layout) -> None:
    check_hop(_act(0, [0, 1]), follower, 16, "solo")
    with pytest.raises(ProtocolError, match=r"hop 1 \(window \[2,4\)\) belongs to node head, not solo"):
        check_hop(_act(1, [0]), follower, 16, "solo")
    # Only the head takes an activation back from the whole ring.
    with pytest.raises(ProtocolError, match="hop index 2 is outside this plan's 2 hops"):
        check_hop(_act(2, [0]), follower, 16, "solo")


def test_positions_past_the_context_are_refused(follower: Layout) -> None:
    check_hop(_act(0, [14, 15]), follower, 16, "solo")
    with pytest.raises(ProtocolError, match="position 16 is beyond the session's context of 16"):
        check_hop(_act(0, [15, 16]), follower, 16, "solo")


def test_nothing_is_taken_before_a_plan(tiny_daemon_model: LoadedModel) -> None:
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=0, threads=1)
    try:
        with pytest.raises(NotReadyError, match="node solo has no plan yet"):
            runtime.arrivals.accept(_act(0, [0]))
        with pytest.raises(ProtocolError, match="the session id is empty"):
            runtime.arrivals.accept(dataclasses.replace(_act(0, [0]), session_id=""))
    finally:
        runtime.shutdown()


def _head_session(runtime: NodeRuntime, in_flight: int) -> queue.SimpleQueue[object]:
    runtime.open_session("s", 1, 16)
    session = runtime.need_session("s")
    results: queue.SimpleQueue[object] = queue.SimpleQueue()
    session.results = results  # type: ignore[assignment]
    session.in_flight = in_flight
    return results


def _arrivals(runtime: NodeRuntime, node_id: str = "solo") -> Arrivals:
    return Arrivals(runtime.plans, runtime.sessions, runtime.worker, node_id)


def test_an_unknown_session_is_refused(solo_runtime: NodeRuntime) -> None:
    with pytest.raises(UnknownSessionError, match="node solo has no session"):
        _arrivals(solo_runtime).accept(embedded(solo_runtime, "s", [5]))


def test_messages_name_the_node(solo_runtime: NodeRuntime) -> None:
    arrivals = _arrivals(solo_runtime, "host:7600")
    _head_session(solo_runtime, in_flight=1)
    stale = dataclasses.replace(embedded(solo_runtime, "s", [5]), plan_epoch=2)
    with pytest.raises(StaleEpochError, match="but node host:7600 runs epoch 1"):
        arrivals.accept(stale)


def test_a_decode_step_at_the_heads_own_hop_goes_to_its_generation(solo_runtime: NodeRuntime) -> None:
    results = _head_session(solo_runtime, in_flight=1)
    act = embedded(solo_runtime, "s", list(range(INLINE_MAX_TOKENS)))
    _arrivals(solo_runtime).accept(act)
    item = results.get_nowait()
    assert isinstance(item, OwnHop)
    assert item.act is act


def test_a_result_back_from_the_ring_goes_to_the_generation_as_it_is(solo_runtime: NodeRuntime) -> None:
    results = _head_session(solo_runtime, in_flight=1)
    act = embedded(solo_runtime, "s", [5], hop_index=len(solo_runtime.need_layout().hops))
    _arrivals(solo_runtime).accept(act)
    assert results.get_nowait() is act


def test_a_prompt_micro_batch_is_computed_by_the_worker(solo_runtime: NodeRuntime) -> None:
    results = _head_session(solo_runtime, in_flight=1)
    ids = list(range(1, INLINE_MAX_TOKENS + 2))
    _arrivals(solo_runtime).accept(embedded(solo_runtime, "s", ids))
    back = results.get(timeout=RESULT_WAIT_S)
    assert isinstance(back, Activation)
    assert back.hop_index == 1  # round the one-hop ring: through this node's layers
    assert back.positions.tolist() == list(range(len(ids)))
    assert back.hidden.shape == (len(ids), solo_runtime.d_model)
