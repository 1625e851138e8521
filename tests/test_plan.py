"""Plan: windows tile the layers in hop order (nodes 1..M-1, then the head, each round), a plan
that does not is a PlanError naming the gap, and the JSON form round-trips."""

from __future__ import annotations

import pytest

from prima.errors import PlanError
from prima.plan import (
    DroppedDevice,
    Hop,
    NodeAssignment,
    Plan,
    Window,
    even_window_sizes,
    plan_from_layer_counts,
    plan_from_window_sizes,
    split_layers,
    windows_text,
)

NODES = [("head", "10.0.0.1:7070"), ("a", "10.0.0.2:7070"), ("b", "10.0.0.3:7070")]


def test_hops_visit_the_other_nodes_then_the_head_each_round() -> None:
    plan = plan_from_window_sizes(NODES, [2, 3, 1], 2, 12)
    assert plan.hops() == [
        Hop(1, 0, Window(0, 3)),
        Hop(2, 0, Window(3, 4)),
        Hop(0, 0, Window(4, 6)),
        Hop(1, 1, Window(6, 9)),
        Hop(2, 1, Window(9, 10)),
        Hop(0, 1, Window(10, 12)),
    ]
    assert plan.head.node_id == "head"
    assert plan.head.windows == (Window(4, 6), Window(10, 12))
    assert [n.n_layers for n in plan.nodes] == [4, 6, 2]
    assert [n.window_size for n in plan.nodes] == [2, 3, 1]


def test_a_node_with_empty_windows_has_no_hops() -> None:
    plan = plan_from_window_sizes(NODES, [4, 0, 2], 1, 6)
    assert [h.node_index for h in plan.hops()] == [2, 0]
    assert plan.nodes[1].windows == (Window(0, 0),)


def test_windows_with_a_gap_are_refused_naming_the_layers() -> None:
    head = NodeAssignment("head", "h:1", (Window(3, 6),))
    other = NodeAssignment("a", "a:1", (Window(0, 2),))
    with pytest.raises(PlanError, match=r"layers \[2,3\) are not assigned"):
        Plan(6, 1, (head, other))


def test_windows_short_of_the_model_are_refused() -> None:
    with pytest.raises(PlanError, match=r"layers \[4,6\) are unassigned"):
        Plan(6, 1, (NodeAssignment("head", "h:1", (Window(0, 4),)),))


@pytest.mark.parametrize(
    ("nodes", "rounds", "words"),
    [
        ((), 1, "at least one node"),
        ((NodeAssignment("head", "h:1", ()),), 0, "rounds must be >= 1"),
        (
            (NodeAssignment("x", "h:1", (Window(0, 1),)), NodeAssignment("x", "a:1", (Window(1, 2),))),
            1,
            "duplicate node ids",
        ),
        ((NodeAssignment("head", "h:1", (Window(0, 2),)),), 2, "1 windows but the plan has 2 rounds"),
    ],
)
def test_inconsistent_plans_are_refused(nodes: tuple[NodeAssignment, ...], rounds: int, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        Plan(2, rounds, nodes)


def test_window_sizes_must_cover_the_model() -> None:
    with pytest.raises(PlanError, match="cover 10 layers but the model has 12"):
        plan_from_window_sizes(NODES, [4, 3, 3], 1, 12)
    with pytest.raises(PlanError, match="3 nodes but 2 window sizes"):
        plan_from_window_sizes(NODES, [6, 6], 1, 12)
    with pytest.raises(PlanError, match=">= 0"):
        plan_from_window_sizes(NODES, [13, -1, 0], 1, 12)


def test_the_json_form_round_trips() -> None:
    plan = plan_from_window_sizes(
        NODES,
        [2, 3, 1],
        2,
        12,
        accel_layers=[0, 2, 0],
        epoch=7,
        predicted_ms_per_token=41.5,
        dropped=[DroppedDevice("far", "faster without it")],
    )
    assert Plan.from_dict(plan.to_dict()) == plan


def test_a_malformed_json_form_is_a_plan_error() -> None:
    raw = plan_from_window_sizes(NODES, [4, 4, 4], 1, 12).to_dict()
    del raw["nodes"][1]["windows"]
    with pytest.raises(PlanError, match="not a plan"):
        Plan.from_dict(raw)
    with pytest.raises(PlanError, match="not a plan"):
        Plan.from_dict({"n_layers": "twelve", "rounds": 1, "nodes": []})


def test_describe_names_every_node_and_drop() -> None:
    plan = plan_from_window_sizes(
        NODES[:2], [3, 3], 1, 6, predicted_ms_per_token=12.0, dropped=[DroppedDevice("far", "too slow")]
    )
    text = plan.describe()
    assert "6 layers, 2 nodes, 1 round(s)" in text
    assert "head    head @ 10.0.0.1:7070: 3 layers [3,6)" in text
    assert "node 1  a @ 10.0.0.2:7070: 3 layers [0,3)" in text
    assert "predicted 12.00 ms/token" in text
    assert "dropped far: too slow" in text


def test_even_window_sizes_give_the_extra_layers_to_the_nodes_after_the_head() -> None:
    assert even_window_sizes(3, 12) == [4, 4, 4]
    assert even_window_sizes(3, 14) == [4, 5, 5]
    assert even_window_sizes(3, 16, rounds=2) == [2, 3, 3]
    with pytest.raises(PlanError, match="pick a divisor of 12"):
        even_window_sizes(2, 12, rounds=5)
    with pytest.raises(PlanError, match="use fewer nodes or rounds"):
        even_window_sizes(5, 4)


def test_split_layers_differ_by_at_most_one_with_the_larger_last() -> None:
    assert split_layers(11, 4) == [2, 3, 3, 3]
    assert split_layers(2, 4) == [0, 0, 1, 1]
    assert split_layers(12, 4) == [3, 3, 3, 3]
    for n, k in [(0, 3), (7, 1), (30, 7), (81, 34)]:
        sizes = split_layers(n, k)
        assert sum(sizes) == n
        assert len(sizes) == k
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes)


def test_plan_from_layer_counts_tiles_the_model_with_the_head_last() -> None:
    nodes = [("head", "h:1"), ("a", "a:1"), ("b", "b:1")]
    plan = plan_from_layer_counts(nodes, [17, 11, 2], 4, 30)
    assert [[str(w) for w in n.windows] for n in plan.nodes] == [
        ["[2,6)", "[9,13)", "[17,21)", "[25,30)"],
        ["[0,2)", "[6,9)", "[13,16)", "[21,24)"],
        ["[2,2)", "[9,9)", "[16,17)", "[24,25)"],
    ]
    assert [n.n_layers for n in plan.nodes] == [17, 11, 2]
    assert plan.hops()[-1].node_index == 0
    assert plan.hops()[-1].window.end == 30
    assert [n.window_size for n in plan.nodes] == [5, 3, 1]
    # Multiples of the rounds give the plan of equal windows.
    assert plan_from_layer_counts(nodes, [8, 12, 4], 4, 24) == plan_from_window_sizes(nodes, [2, 3, 1], 4, 24)


@pytest.mark.parametrize(
    ("counts", "rounds", "words"),
    [
        ([10, 10, 9], 2, "cover 29 layers but the model has 30"),
        ([31, -1, 0], 2, ">= 0"),
        ([30, 0, 0], 0, ">= 1"),
    ],
)
def test_bad_layer_counts_are_refused(counts: list[int], rounds: int, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        plan_from_layer_counts([("h", "h:1"), ("a", "a:1"), ("b", "b:1")], counts, rounds, 30)


def test_windows_text_leaves_out_the_rounds_a_node_sits_out() -> None:
    plan = plan_from_layer_counts([("head", "h:1"), ("a", "a:1"), ("b", "b:1")], [17, 11, 2], 4, 30)
    assert windows_text(plan.nodes[2].windows) == "[16,17) [24,25)"
    assert windows_text(()) == "-"
    assert "b @ b:1: 2 layers [16,17) [24,25)" in plan.describe()
