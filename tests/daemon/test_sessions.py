"""A daemon's sessions (prima.daemon.sessions): opened against the current plan within the
bounds on count and KV memory, refused before their cache exists, given back on close, ended
with a message when a plan replaces them, and refused once the daemon stops taking work."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterator

import pytest

from prima.daemon.install import build_layout
from prima.daemon.sessions import Sessions, end_sessions
from prima.daemon.state import Layout
from prima.errors import InputError, NodeError, ProtocolError
from prima.forward.loader import LoadedModel
from prima.net.codec import WireDType
from prima.net.limits import DaemonLimits
from prima.net.status import (
    PayloadTooLargeError,
    ShuttingDownError,
    StaleEpochError,
    UnknownSessionError,
)
from tests.daemon.conftest import solo_plan

EPOCH = 1


@pytest.fixture
def layout(tiny_daemon_model: LoadedModel) -> Iterator[Layout]:
    """A head holding every layer, its layer budget measured (auto), as primad's default."""
    built, _ = build_layout(
        tiny_daemon_model, solo_plan(), 0, WireDType.F32, node_id="solo", budget_bytes=None, identity=None
    )
    yield built
    built.close()


def _sessions(loaded: LoadedModel, **bounds: int) -> Sessions:
    return Sessions(loaded.model, "solo", DaemonLimits(**bounds))


def test_a_session_holds_a_cache_of_this_nodes_layers(tiny_daemon_model: LoadedModel, layout: Layout) -> None:
    sessions = _sessions(tiny_daemon_model)
    session = sessions.open("a", EPOCH, 16, layout)
    assert sessions.find("a") is session
    assert sessions.need("a") is session
    assert sessions.ids() == ["a"]
    assert len(sessions) == 1
    assert (session.n_ctx, session.epoch) == (16, EPOCH)
    assert sessions.held_kv_bytes() == session.cache.n_bytes > 0


def test_kv_caches_come_out_of_an_auto_layer_budget(tiny_daemon_model: LoadedModel, layout: Layout) -> None:
    assert layout.auto_budget is not None
    sessions = _sessions(tiny_daemon_model)
    session = sessions.open("a", EPOCH, 64, layout)
    assert layout.windows.budget_bytes == layout.auto_budget - session.cache.n_bytes
    sessions.close("a", layout)
    assert layout.windows.budget_bytes == layout.auto_budget
    assert sessions.find("a") is None


def test_a_session_that_leaves_the_layers_no_room_is_closed_again(
    tiny_daemon_model: LoadedModel, layout: Layout
) -> None:
    cramped = dataclasses.replace(layout, auto_budget=layout.windows.largest_layer_bytes)
    sessions = _sessions(tiny_daemon_model)
    with pytest.raises(InputError, match="leave no room for its layers"):
        sessions.open("a", EPOCH, 64, cramped)
    assert len(sessions) == 0


def test_sessions_past_the_count_are_refused(tiny_daemon_model: LoadedModel, layout: Layout) -> None:
    sessions = _sessions(tiny_daemon_model, max_sessions=2)
    sessions.open("a", EPOCH, 8, layout)
    sessions.open("b", EPOCH, 8, layout)
    with pytest.raises(PayloadTooLargeError, match="already holds 2 sessions"):
        sessions.open("c", EPOCH, 8, layout)


def test_a_cache_past_the_kv_bound_is_refused(tiny_daemon_model: LoadedModel, layout: Layout) -> None:
    sessions = _sessions(tiny_daemon_model, max_kv_bytes=1 << 10)
    with pytest.raises(PayloadTooLargeError, match="KV cache would pass"):
        sessions.open("a", EPOCH, 64, layout)
    assert len(sessions) == 0


@pytest.mark.parametrize(
    ("session_id", "epoch", "n_ctx", "error", "words"),
    [
        ("a", EPOCH + 1, 8, StaleEpochError, "for plan epoch 2 but node solo runs epoch 1"),
        ("a", EPOCH, 0, InputError, "context size 0 is outside"),
        ("a", EPOCH, 1 << 30, InputError, "is outside"),
    ],
)
def test_a_session_the_plan_cannot_hold_is_refused(
    tiny_daemon_model: LoadedModel,
    layout: Layout,
    session_id: str,
    epoch: int,
    n_ctx: int,
    error: type[Exception],
    words: str,
) -> None:
    with pytest.raises(error, match=words):
        _sessions(tiny_daemon_model).open(session_id, epoch, n_ctx, layout)


def test_an_id_is_opened_once(tiny_daemon_model: LoadedModel, layout: Layout) -> None:
    sessions = _sessions(tiny_daemon_model)
    sessions.open("a", EPOCH, 8, layout)
    with pytest.raises(ProtocolError, match="already open"):
        sessions.open("a", EPOCH, 8, layout)


def test_an_unknown_session_names_the_node(tiny_daemon_model: LoadedModel) -> None:
    with pytest.raises(UnknownSessionError, match="node solo has no session"):
        _sessions(tiny_daemon_model).need("nope")


def test_stopping_refuses_new_sessions_and_keeps_the_open_ones(
    tiny_daemon_model: LoadedModel, layout: Layout
) -> None:
    sessions = _sessions(tiny_daemon_model)
    sessions.open("a", EPOCH, 8, layout)
    assert sessions.stop_taking_work() == ["a"]
    assert sessions.stopping
    with pytest.raises(ShuttingDownError, match="takes no new sessions"):
        sessions.open("b", EPOCH, 8, layout)
    with pytest.raises(ShuttingDownError, match="takes no new plan"):
        sessions.check_not_stopping("plan")
    assert sessions.ids() == ["a"]


def test_sessions_taken_off_end_their_generations_with_why(
    tiny_daemon_model: LoadedModel, layout: Layout
) -> None:
    sessions = _sessions(tiny_daemon_model)
    head_side = sessions.open("a", EPOCH, 8, layout)
    head_side.results = queue.SimpleQueue()
    sessions.open("b", EPOCH, 8, layout)
    taken = sessions.take_all()
    assert len(sessions) == 0
    assert sorted(s.session_id for s in taken) == ["a", "b"]
    end_sessions(taken, "a new plan")
    error = head_side.results.get_nowait()
    assert isinstance(error, NodeError)
    assert "session ended: a new plan" in str(error)


def test_a_flood_of_aborts_queues_one_error(tiny_daemon_model: LoadedModel, layout: Layout) -> None:
    sessions = _sessions(tiny_daemon_model)
    session = sessions.open("a", EPOCH, 8, layout)
    session.results = queue.SimpleQueue()
    for i in range(5):
        sessions.abort("a", "peer", f"failure {i}")
    sessions.abort("unknown", "peer", "nothing to end")
    assert session.results.qsize() == 1
    assert "node 'peer': failure 0" in str(session.results.get_nowait())
