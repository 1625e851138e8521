"""NodeRuntime, a daemon behind its servicer: before a plan it says what it waits for; a plan
is taken on, a newer one ends the sessions of the old; arriving activations are checked
against the plan and session, and those of the head's own hops go to its generation thread as
OwnHops; once stopping it takes no new work."""

from __future__ import annotations

import dataclasses
import queue

import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.daemon.state import OwnHop
from prima.errors import NodeError, ProtocolError
from prima.forward.loader import LoadedModel
from prima.net.codec import WireDType
from prima.net.status import (
    NotReadyError,
    PermissionDeniedError,
    ShuttingDownError,
    StaleEpochError,
    UnknownSessionError,
)
from tests.daemon.conftest import embedded, solo_plan


def test_before_a_plan_it_says_so(tiny_daemon_model: LoadedModel) -> None:
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=0, threads=1)
    try:
        assert runtime.info().status == "idle: waiting for a plan"
        assert runtime.layout is None
        with pytest.raises(NotReadyError, match="node solo has no plan yet; send LoadPlan first"):
            runtime.need_layout()
        runtime.authorize("OpenSession", "anyone")  # nothing to protect yet
    finally:
        runtime.shutdown()


def test_a_plan_is_taken_on(solo_runtime: NodeRuntime) -> None:
    info = solo_runtime.info()
    assert info.status == "ready"
    assert info.plan_epoch == 1
    assert [(w.start, w.end) for w in info.windows] == [(0, 4)]
    assert solo_runtime.need_layout().is_head


def test_a_newer_plan_ends_the_sessions_of_the_old(solo_runtime: NodeRuntime) -> None:
    solo_runtime.open_session("old", 1, 16)
    session = solo_runtime.need_session("old")
    session.results = queue.SimpleQueue()
    solo_runtime.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
    assert solo_runtime.session_ids() == []
    error = session.results.get_nowait()
    assert isinstance(error, NodeError)
    assert "node solo loaded plan epoch 2" in str(error)
    solo_runtime.open_session("new", 2, 16)  # the new plan's sessions open as usual
    assert solo_runtime.session_ids() == ["new"]


def test_the_plans_owner_keeps_its_sessions(solo_runtime: NodeRuntime) -> None:
    solo_runtime.load_plan(solo_plan(epoch=2), "solo", WireDType.F32, owner="coord-a")
    solo_runtime.authorize("OpenSession", "coord-a")
    solo_runtime.authorize("OpenSession", "solo")  # a node of the plan
    with pytest.raises(PermissionDeniedError, match="may not call OpenSession on node solo"):
        solo_runtime.authorize("OpenSession", "coord-b")


def test_a_new_node_id_is_what_messages_say(solo_runtime: NodeRuntime) -> None:
    solo_runtime.node_id = "host:7600"
    assert solo_runtime.info().node_id == "host:7600"
    with pytest.raises(UnknownSessionError, match="node host:7600 has no session"):
        solo_runtime.need_session("nope")


def test_a_new_node_id_reaches_every_part(tiny_daemon_model: LoadedModel) -> None:
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=0, threads=1)
    try:
        runtime.node_id = "host:7600"
        with pytest.raises(NotReadyError, match="node host:7600 has no plan yet"):
            runtime.need_layout()
        runtime.load_plan(solo_plan(), "solo", WireDType.F32)
        runtime.open_session("s", 1, 16)
        stale = dataclasses.replace(embedded(runtime, "s", [5]), plan_epoch=2)
        with pytest.raises(StaleEpochError, match="but node host:7600 runs epoch 1"):
            runtime.accept(stale)
    finally:
        runtime.shutdown()


def _head_session(runtime: NodeRuntime, session_id: str, in_flight: int) -> queue.SimpleQueue[object]:
    runtime.open_session(session_id, 1, 16)
    session = runtime.need_session(session_id)
    results: queue.SimpleQueue[object] = queue.SimpleQueue()
    session.results = results  # type: ignore[assignment]
    session.in_flight = in_flight
    return results


def test_a_decode_step_at_the_heads_own_hop_goes_to_its_generation(solo_runtime: NodeRuntime) -> None:
    results = _head_session(solo_runtime, "s", in_flight=1)
    act = embedded(solo_runtime, "s", [5])
    solo_runtime.accept(act)
    item = results.get_nowait()
    assert isinstance(item, OwnHop)
    assert item.act is act


def test_a_result_back_from_the_ring_is_handed_back_as_it_is(solo_runtime: NodeRuntime) -> None:
    results = _head_session(solo_runtime, "s", in_flight=1)
    n_hops = len(solo_runtime.need_layout().hops)
    act = embedded(solo_runtime, "s", [5], hop_index=n_hops)
    solo_runtime.accept(act)
    assert results.get_nowait() is act


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"hop_index": 9}, "hop index 9 is outside this plan's 1 hops"),
        ({"positions": np.array([16])}, "position 16 is beyond the session's context of 16"),
    ],
)
def test_an_activation_the_plan_does_not_allow_is_refused(
    solo_runtime: NodeRuntime, change: dict[str, object], words: str
) -> None:
    _head_session(solo_runtime, "s", in_flight=1)
    act = embedded(solo_runtime, "s", [5])
    with pytest.raises(ProtocolError, match=words):
        solo_runtime.accept(dataclasses.replace(act, **change))  # type: ignore[arg-type]


def test_stopping_refuses_plans_and_sessions(solo_runtime: NodeRuntime) -> None:
    solo_runtime.open_session("a", 1, 16)
    assert solo_runtime.stop_taking_work() == ["a"]
    assert solo_runtime.info().status.startswith("shutting down: finishing 1 session(s)")
    with pytest.raises(ShuttingDownError, match="takes no new plan"):
        solo_runtime.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
    with pytest.raises(ShuttingDownError, match="takes no new sessions"):
        solo_runtime.open_session("b", 1, 16)


def test_cutting_a_followers_session_closes_it(solo_runtime: NodeRuntime) -> None:
    solo_runtime.open_session("a", 1, 16)  # not the head's: no results queue
    solo_runtime.cut_session("a", "shutting down")
    assert solo_runtime.find_session("a") is None
    solo_runtime.cut_session("a", "again: nothing to cut")
