"""What a daemon answers to Info (prima.daemon.node_info): idle before a plan, ready with its
windows and hop times once one is installed, the fetch and its failure while it has none, and
that it is shutting down once it stops taking work."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.daemon.fetching import WindowFetcher
from prima.daemon.hop_times import HopTimes
from prima.daemon.node_info import NodeInfo
from prima.daemon.plan_holder import PlanHolder
from prima.daemon.sessions import Sessions
from prima.forward.loader import LoadedModel
from prima.model.sparse import SparseFile
from prima.net.codec import PROTOCOL_VERSION, WireDType
from prima.net.limits import DaemonLimits
from prima.net.node_status import HopTiming
from prima.plan import Window
from tests.daemon.conftest import N_LAYERS, solo_plan

FETCH_WAIT_S = 30.0  # bound on the wait for a background fetch to give up


def _info(loaded: LoadedModel, store: SparseFile) -> NodeInfo:
    sessions = Sessions(loaded.model, "solo", DaemonLimits())
    plans = PlanHolder(loaded, sessions, WindowFetcher(store), "solo", budget_bytes=0)
    return NodeInfo(loaded, "fp-1", plans, sessions, HopTimes(), store)


@pytest.fixture
def info(tiny_daemon_model: LoadedModel) -> Iterator[NodeInfo]:
    loaded = tiny_daemon_model
    node = _info(loaded, SparseFile.open(loaded.path, loaded.gguf.fingerprint()))
    yield node
    if node.plans.layout is not None:
        node.plans.layout.close()


def test_before_a_plan_it_is_idle(info: NodeInfo, tiny_daemon_model: LoadedModel) -> None:
    status = info.status("solo", 0)
    assert status.status == "idle: waiting for a plan"
    assert (status.node_id, status.protocol_version) == ("solo", PROTOCOL_VERSION)
    assert (status.model_name, status.model_fingerprint) == (tiny_daemon_model.name, "fp-1")
    assert (status.n_layers, status.d_model) == (N_LAYERS, tiny_daemon_model.model.config.d_model)
    assert status.healthy
    assert (status.plan_epoch, status.windows, status.residency) == (0, (), None)
    assert (status.fetch, status.hop_times) == (None, ())
    assert status.holds_full_file
    assert (status.draft_model_name, status.draft_model_fingerprint) == ("", "")


def test_with_a_plan_it_is_ready_with_its_windows_and_hop_times(info: NodeInfo) -> None:
    info.plans.load_plan(solo_plan(epoch=3), "solo", WireDType.F32)
    info.sessions.open("s", 3, 16, info.plans.need_layout())
    info.hop_times.add_compute(2, 0, 1, 9.0)  # an older plan's: not this one's hops
    info.hop_times.add_compute(3, 0, 1, 2.5)
    status = info.status("host:7600", 7601)
    assert status.status == "ready"
    assert (status.node_id, status.link_port) == ("host:7600", 7601)
    assert status.plan_epoch == 3
    assert status.windows == (Window(0, N_LAYERS),)
    assert status.residency is not None
    assert status.sessions == 1
    assert status.hop_times == (HopTiming(0, 1, 2.5, 0.0),)


def test_a_stopping_node_says_what_it_finishes(info: NodeInfo) -> None:
    info.plans.load_plan(solo_plan(), "solo", WireDType.F32)
    info.sessions.open("s", 1, 16, info.plans.need_layout())
    info.sessions.stop_taking_work()
    assert info.status("solo", 0).status == "shutting down: finishing 1 session(s), taking no new ones"


def test_a_failed_fetch_is_shown_and_unhealthy(tiny_daemon_model: LoadedModel, tmp_path: Path) -> None:
    loaded = tiny_daemon_model
    store = SparseFile.create(tmp_path / "part.gguf", loaded.gguf.fingerprint(), loaded.path.stat().st_size)
    info = _info(loaded, store)
    try:
        info.plans.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
        status = info.status("solo", 0)
        assert status.plan_epoch == 2  # the plan being fetched
        assert status.fetch is not None
        assert not status.holds_full_file
        waited = threading.Event()
        for _ in range(int(FETCH_WAIT_S / 0.01)):
            if info.status("solo", 0).fetch.error:  # type: ignore[union-attr]
                break
            waited.wait(0.01)
        status = info.status("solo", 0)
        assert not status.healthy
        assert status.status.startswith(
            "fetch for plan epoch 2 failed: node solo holds only part of its model"
        )
    finally:
        info.plans.cancel_fetch()
        store.close()
