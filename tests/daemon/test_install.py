"""Taking a plan on (prima.daemon.install): a plan that cannot run here is refused with what to
do, and a plan that can is built into a Layout of this node's windows, hops and peers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prima.daemon.install import build_layout, check_plan
from prima.daemon.state import Layout
from prima.errors import PlanError
from prima.forward.loader import LoadedModel
from prima.forward.placement import Piece
from prima.net.codec import WireDType
from prima.net.status import StaleEpochError
from prima.plan import Window, plan_from_window_sizes
from tests.daemon.conftest import N_LAYERS, pair_plan, solo_plan


def test_a_plan_gives_this_nodes_index(tiny_daemon_model: LoadedModel) -> None:
    assert check_plan(solo_plan(), "solo", tiny_daemon_model, None) == 0
    assert check_plan(pair_plan(), "solo", tiny_daemon_model, None) == 1


def test_a_plan_for_another_model_is_refused(tiny_daemon_model: LoadedModel) -> None:
    plan = plan_from_window_sizes([("solo", "127.0.0.1:1")], [6], 1, 6)
    with pytest.raises(PlanError, match=f"covers 6 layers but this node's model .* has {N_LAYERS}"):
        check_plan(plan, "solo", tiny_daemon_model, None)


def test_a_node_missing_from_the_plan_is_refused(tiny_daemon_model: LoadedModel) -> None:
    with pytest.raises(PlanError, match="is not in the plan"):
        check_plan(solo_plan(), "other", tiny_daemon_model, None)


def test_an_older_epoch_is_refused(tiny_daemon_model: LoadedModel) -> None:
    with pytest.raises(StaleEpochError, match="older than the loaded epoch 3"):
        check_plan(solo_plan(epoch=2), "solo", tiny_daemon_model, 3)


def test_accelerator_layers_on_a_cpu_node_are_refused(tiny_daemon_model: LoadedModel) -> None:
    plan = plan_from_window_sizes([("solo", "127.0.0.1:1")], [N_LAYERS], 1, N_LAYERS, accel_layers=[2])
    with pytest.raises(PlanError, match="on an accelerator, but it computes on the cpu backend"):
        check_plan(plan, "solo", tiny_daemon_model, None)


@pytest.fixture
def follower(tiny_daemon_model: LoadedModel) -> Iterator[tuple[Layout, set[Piece]]]:
    layout, keep = build_layout(
        tiny_daemon_model, pair_plan(), 1, WireDType.F16, node_id="solo", budget_bytes=0, identity=None
    )
    yield layout, keep
    layout.close()


def test_a_follower_layout_holds_its_window_and_a_channel_to_the_head(
    follower: tuple[Layout, set[Piece]],
) -> None:
    layout, keep = follower
    assert layout.me == 1
    assert not layout.is_head
    assert layout.layers() == [0, 1]
    assert layout.plan.nodes[1].windows == (Window(0, 2),)
    assert set(layout.clients) == {0}  # the head: the next hop, and who hears of failures
    assert layout.wire_dtype is WireDType.F16
    assert layout.auto_budget is None  # a budget given, not measured
    assert {p.layers for p in keep} >= {range(0, 2)}


def test_an_auto_budget_is_measured_at_load(tiny_daemon_model: LoadedModel) -> None:
    layout, _ = build_layout(
        tiny_daemon_model, solo_plan(), 0, WireDType.F32, node_id="solo", budget_bytes=None, identity=None
    )
    try:
        assert layout.is_head
        assert layout.clients == {}
        assert layout.auto_budget is not None
        assert layout.auto_budget > 0
    finally:
        layout.close()
