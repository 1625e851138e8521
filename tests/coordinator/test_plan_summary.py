"""The plan's one line on the terminal: each node's windows in the order they run, Halda's
prediction, and why the daemons it left out are idle, from plans Halda really made."""

from __future__ import annotations

from prima.coordinator.plan_summary import describe_plan
from prima.plan import plan_from_window_sizes
from prima.scheduler import halda
from tests.scheduler.conftest import make_device, make_model


def test_a_split_ring_lists_each_nodes_layers_in_the_order_they_run() -> None:
    model = make_model(n_layers=12, layer_mib=200, kv_mib=2)
    # Neither holds the model alone: "big" takes 9 layers, "small" 3 (as in test_halda).
    devices = [
        make_device("big", ram_gib=2.0, disk_gbps=0.0),
        make_device("small", ram_gib=0.65, disk_gbps=0.0, gflops=40.0),
    ]
    plan = halda.solve(devices, model)
    line = describe_plan(plan, devices, model)
    assert (
        line
        == f"plan: small [0,3), big [3,12) (head); Halda predicts {plan.predicted_ms_per_token:.1f} ms/token"
    )


def test_daemons_left_out_of_a_model_that_fits_one_are_idle_for_that_reason() -> None:
    model = make_model(n_layers=12, layer_mib=100)
    devices = [
        make_device("desktop", ram_gib=16.0, gflops=80.0, mem_gbps=50.0),
        make_device("laptop", ram_gib=2.0, gflops=10.0),
        make_device("phone", ram_gib=1.0, gflops=8.0),
    ]
    plan = halda.solve(devices, model)
    assert describe_plan(plan, devices, model).endswith(
        "; laptop, phone idle: the model fits in desktop's memory and each extra hop would cost more "
        "than it saves"
    )


def test_each_reason_for_idling_gets_its_own_group() -> None:
    model = make_model(n_layers=12, layer_mib=200, kv_mib=2)
    devices = [
        make_device("big", ram_gib=2.0, disk_gbps=0.0),
        make_device("small", ram_gib=0.65, disk_gbps=0.0, gflops=40.0),
        make_device("watch", ram_gib=0.1, disk_gbps=0.0),
        make_device("far", ram_gib=0.65, disk_gbps=0.0, latency_ms=400.0),
    ]
    plan = halda.solve(devices, model)
    assert [n.node_id for n in plan.nodes] == ["big", "small"]
    line = describe_plan(plan, devices, model)
    assert "; watch idle: too little memory for one layer with its KV cache (202 MiB)" in line
    assert line.endswith(
        "; far idle: the model fits in the memory of big and small and each extra hop would cost more "
        "than it saves"
    )


def test_a_node_that_streams_says_how_many_layers_it_rereads_and_the_model_does_not_fit() -> None:
    model = make_model(n_layers=12, layer_mib=200, kv_mib=2)
    # "tiny" is short of memory for its layers and streams them (as in test_halda's rounds test).
    devices = [
        make_device("home", ram_gib=1.8, disk_gbps=0.0),
        make_device("tiny", ram_gib=0.6, disk_gbps=3.0),
        make_device("far", ram_gib=0.6, latency_ms=400.0),
    ]
    plan = halda.solve(devices, model)
    line = describe_plan(plan, devices, model)
    assert plan.rounds == 2
    assert line.startswith(
        "plan: tiny [0,2) [6,8) (rereads 4 layer(s) a token from disk), home [2,6) [8,12) (head)"
    )
    assert line.endswith("; far idle: each extra hop would cost more than it saves")


def test_a_plan_by_hand_has_windows_and_no_prediction() -> None:
    plan = plan_from_window_sizes([("node0", "a:1"), ("node1", "b:1")], [10, 5], 2, 30)
    assert describe_plan(plan) == (
        "plan: node1 [0,5) [15,20), node0 [5,15) [20,30) (head); windows by hand, no prediction"
    )


def test_without_profiles_an_idle_daemon_keeps_haldas_own_words() -> None:
    model = make_model(n_layers=12, layer_mib=100)
    devices = [make_device("desktop", ram_gib=16.0, gflops=80.0), make_device("phone", ram_gib=1.0)]
    plan = halda.solve(devices, model)
    assert describe_plan(plan).endswith(f"; phone idle: {plan.dropped[0].reason}")
