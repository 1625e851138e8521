"""The plan a daemon runs (prima.daemon.plan_holder): before a plan it says what it waits for; a
plan is installed with its owner, a newer one ends the sessions of the old and an older one is
refused; a node holding part of its model fetches first, says why it is not ready while the
fetch is missing or failed, and a failed fetch is tried again when the plan comes again."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.daemon.fetching import WindowFetcher
from prima.daemon.plan_holder import PlanHolder
from prima.daemon.sessions import Sessions
from prima.errors import NodeError
from prima.forward.loader import LoadedModel
from prima.model.sparse import SparseFile
from prima.net.codec import WireDType
from prima.net.limits import DaemonLimits
from prima.net.status import NotReadyError, ShuttingDownError, StaleEpochError
from tests.daemon.conftest import solo_plan

FETCH_WAIT_S = 30.0  # bound on the wait for a background fetch to give up


def _holder(loaded: LoadedModel, store: SparseFile) -> PlanHolder:
    sessions = Sessions(loaded.model, "solo", DaemonLimits())
    return PlanHolder(loaded, sessions, WindowFetcher(store), "solo", budget_bytes=0)


@pytest.fixture
def holder(tiny_daemon_model: LoadedModel) -> Iterator[PlanHolder]:
    """A holder over the whole model file."""
    loaded = tiny_daemon_model
    h = _holder(loaded, SparseFile.open(loaded.path, loaded.gguf.fingerprint()))
    yield h
    h.cancel_fetch()
    if h.layout is not None:
        h.layout.close()


@pytest.fixture
def partial_holder(tiny_daemon_model: LoadedModel, tmp_path: Path) -> Iterator[PlanHolder]:
    """A holder whose model file holds none of its bytes, with nobody to fetch them from."""
    loaded = tiny_daemon_model
    size = loaded.path.stat().st_size
    store = SparseFile.create(tmp_path / "part.gguf", loaded.gguf.fingerprint(), size)
    h = _holder(loaded, store)
    yield h
    h.cancel_fetch()
    store.close()


def test_before_a_plan_it_says_so(holder: PlanHolder) -> None:
    assert holder.layout is None
    assert holder.ownership is None
    assert holder.residency() is None
    with pytest.raises(NotReadyError, match="node solo has no plan yet; send LoadPlan first"):
        holder.need_layout()
    holder.node_id = "host:7600"
    with pytest.raises(NotReadyError, match="node host:7600 has no plan yet"):
        holder.need_layout()


def test_a_plan_is_installed_with_its_owner(holder: PlanHolder) -> None:
    holder.load_plan(solo_plan(), "solo", WireDType.F16, owner="coord-a")
    layout = holder.need_layout()
    assert holder.plan == solo_plan()
    assert (layout.me, layout.wire_dtype) == (0, WireDType.F16)
    assert holder.fetch is None  # the whole file needs no fetch
    ownership = holder.ownership
    assert ownership is not None
    assert (ownership.plan, ownership.owner) == (solo_plan(), "coord-a")
    assert holder.residency() is not None


def test_a_newer_plan_ends_the_sessions_of_the_old(holder: PlanHolder) -> None:
    holder.load_plan(solo_plan(), "solo", WireDType.F32)
    old = holder.need_layout()
    session = holder.sessions.open("s", 1, 16, old)
    session.results = queue.SimpleQueue()
    holder.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
    assert holder.plan.epoch == 2
    assert holder.need_layout() is not old
    assert holder.sessions.ids() == []
    error = session.results.get_nowait()
    assert isinstance(error, NodeError)
    assert "node solo loaded plan epoch 2" in str(error)


def test_an_older_plan_is_refused(holder: PlanHolder) -> None:
    holder.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
    with pytest.raises(StaleEpochError, match="older than the loaded epoch 2"):
        holder.load_plan(solo_plan(epoch=1), "solo", WireDType.F32)
    assert holder.plan.epoch == 2


def test_a_stopping_node_takes_no_plan(holder: PlanHolder) -> None:
    holder.sessions.stop_taking_work()
    with pytest.raises(ShuttingDownError, match="takes no new plan"):
        holder.load_plan(solo_plan(), "solo", WireDType.F32)
    assert holder.layout is None


def _wait_for_error(holder: PlanHolder) -> str:
    fetch = holder.fetch
    assert fetch is not None
    gave_up = threading.Event()
    for _ in range(int(FETCH_WAIT_S / 0.01)):
        if fetch.progress().error:
            return fetch.progress().error
        gave_up.wait(0.01)
    raise AssertionError(f"the fetch did not end within {FETCH_WAIT_S} s")


def test_a_partial_file_fetches_before_it_installs(partial_holder: PlanHolder) -> None:
    partial_holder.load_plan(solo_plan(), "solo", WireDType.F32, owner="coord-a")
    first = partial_holder.fetch
    assert first is not None
    assert first.plan == solo_plan()
    assert partial_holder.layout is None
    assert partial_holder.ownership is None  # nothing to protect until the plan is installed
    error = _wait_for_error(partial_holder)
    assert "no peer could send" in error
    with pytest.raises(
        NotReadyError, match="node solo is not ready: fetch for plan epoch 1 failed: node solo"
    ):
        partial_holder.need_layout()
    # The same plan again after its fetch failed starts another fetch.
    partial_holder.load_plan(solo_plan(), "solo", WireDType.F32)
    assert partial_holder.fetch is not first
    assert first.cancelled


def test_a_plan_being_fetched_ends_the_sessions_of_the_old(
    holder: PlanHolder, tiny_daemon_model: LoadedModel, tmp_path: Path
) -> None:
    holder.load_plan(solo_plan(), "solo", WireDType.F32)
    session = holder.sessions.open("s", 1, 16, holder.need_layout())
    session.results = queue.SimpleQueue()
    size = tiny_daemon_model.path.stat().st_size
    holder.fetcher = WindowFetcher(SparseFile.create(tmp_path / "part.gguf", "f", size))
    holder.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
    assert holder.layout is None
    assert holder.sessions.ids() == []
    assert "node solo is fetching the windows of plan epoch 2" in str(session.results.get_nowait())
    with pytest.raises(StaleEpochError, match="older than the loaded epoch 2"):
        holder.load_plan(solo_plan(epoch=1), "solo", WireDType.F32)  # the fetched plan's epoch counts
    holder.cancel_fetch()
    holder.fetcher.store.close()
