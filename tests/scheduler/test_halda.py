"""Halda against brute force under the same cost model, and scenarios with obvious answers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from prima.errors import PlanError
from prima.plan import Plan
from prima.scheduler import halda
from prima.scheduler.cost_model import (
    pinned_layers,
    predict_ms_per_token,
    ring_costs,
    ring_time_of_counts,
    streams,
)
from prima.scheduler.profile_schema import AcceleratorProfile
from tests.scheduler.conftest import MiB, make_device, make_model
from tests.scheduler.halda_oracle import brute_force, brute_force_counts


@pytest.mark.parametrize("seed", range(50))
def test_halda_matches_brute_force_on_random_clusters(seed, random_cluster):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    expected = brute_force_counts(costs, model.n_layers)
    if not math.isfinite(expected):
        with pytest.raises(PlanError, match="no assignment"):
            halda.solve(devices, model)
        return
    plan = halda.solve(devices, model)
    assert plan.predicted_ms_per_token == pytest.approx(expected, rel=1e-9)
    # Never worse than the best plan whose windows are equal in every round.
    assert plan.predicted_ms_per_token <= brute_force(costs, model.n_layers) * (1 + 1e-9)
    # The plan's own windows, re-scored from scratch, give the same time.
    by_id = {d.node_id: d for d in devices}
    ring = [by_id[n.node_id] for n in plan.nodes]
    accel = [n.accel_layers for n in plan.nodes]
    counts = [n.n_layers for n in plan.nodes]
    rescored = ring_time_of_counts(ring_costs(ring, model), plan.rounds, counts, accel)
    assert rescored == pytest.approx(expected, rel=1e-9)
    # Each node's windows differ by at most a layer.
    assert all(
        max(w.n_layers for w in n.windows) - min(w.n_layers for w in n.windows) <= 1 for n in plan.nodes
    )
    assert {n.node_id for n in plan.nodes} | {d.node_id for d in plan.dropped} == set(by_id)


def test_halda_some_random_clusters_stream_and_drop(random_cluster):
    """Guard on the generator: the random cases exercise streaming, dropping and accelerators."""
    rounds, dropped, accel = set(), 0, 0
    for seed in range(50):
        devices, model = random_cluster(seed)
        try:
            plan = halda.solve(devices, model)
        except PlanError:
            continue
        rounds.add(plan.rounds)
        dropped += len(plan.dropped)
        accel += sum(n.accel_layers for n in plan.nodes)
    assert len(rounds) > 1
    assert dropped > 0
    assert accel > 0


def test_halda_gives_a_small_memory_device_fewer_layers(make_device, make_model):
    model = make_model(n_layers=12, layer_mib=200, kv_mib=2)
    # Neither can stream and neither holds the model alone (12 x 202 MiB + 128 MiB head tensors):
    # "big" holds 9 layers, "small" 3, and the small one is even the faster of the two.
    devices = [
        make_device("big", ram_gib=2.0, disk_gbps=0.0),
        make_device("small", ram_gib=0.65, disk_gbps=0.0, gflops=40.0),
    ]
    plan = halda.solve(devices, model)
    sizes = {n.node_id: n.n_layers for n in plan.nodes}
    assert sizes == {"big": 9, "small": 3}


def test_halda_drops_a_device_behind_a_slow_network(make_device, make_model):
    model = make_model(n_layers=12, layer_mib=200)
    devices = [
        make_device("head", ram_gib=1.6),
        make_device("fast", ram_gib=1.6),
        make_device("far", ram_gib=1.6, latency_ms=400.0),
    ]
    plan = halda.solve(devices, model)
    assert [n.node_id for n in plan.nodes] == ["head", "fast"]
    (dropped,) = plan.dropped
    assert dropped.node_id == "far"
    assert dropped.reason.startswith("faster without it")
    assert "400.3 ms hop" in dropped.reason


def test_halda_drops_a_device_with_slow_compute(make_device, make_model):
    model = make_model(n_layers=8, layer_mib=200)
    devices = [make_device("head", ram_gib=4.0), make_device("slow", ram_gib=4.0, gflops=0.05)]
    plan = halda.solve(devices, model)
    assert [n.node_id for n in plan.nodes] == ["head"]
    assert plan.dropped[0].node_id == "slow"
    assert plan.dropped[0].reason.startswith("faster without it")


def test_halda_puts_a_model_that_fits_one_strong_device_on_it_alone(make_device, make_model):
    model = make_model(n_layers=12, layer_mib=100)
    devices = [
        make_device("laptop", ram_gib=2.0, gflops=10.0),
        make_device("desktop", ram_gib=16.0, gflops=80.0, mem_gbps=50.0),
        make_device("phone", ram_gib=1.0, gflops=8.0),
    ]
    # The desktop is the head here, so it can run alone with no network hops at all.
    plan = halda.solve([devices[1], devices[0], devices[2]], model)
    assert [n.node_id for n in plan.nodes] == ["desktop"]
    assert plan.rounds == 1
    assert plan.head.n_layers == 12
    assert {d.node_id for d in plan.dropped} == {"laptop", "phone"}


def test_halda_short_of_memory_uses_rounds_and_streams(make_device, make_model):
    model = make_model(n_layers=12, layer_mib=200, kv_mib=2)
    # 12 x 202 MiB of layers; "home" holds 8 of them and has no disk to stream from, "tiny" holds
    # 2 but reads 3 GB/s. Streaming needs a buffer of one window + one layer besides what it pins,
    # so tiny needs at least 2 rounds; home takes all it can hold and tiny streams the rest.
    devices = [
        make_device("home", ram_gib=1.8, disk_gbps=0.0),
        make_device("tiny", ram_gib=0.6, disk_gbps=3.0),
    ]
    plan = halda.solve(devices, model)
    k = plan.rounds
    assert k > 1
    assert [(n.node_id, n.n_layers) for n in plan.nodes] == [("home", 8), ("tiny", 4)]
    home, tiny = ring_costs(devices, model)
    assert not streams(home, k, 8 // k, 0)
    assert streams(tiny, k, 4 // k, 0)
    assert pinned_layers(tiny, k, 4 // k) < 4
    # Streaming costs disk time: slower than a ring that fits.
    roomy = [make_device("home", ram_gib=1.8, disk_gbps=0.0), make_device("tiny", ram_gib=2.0)]
    assert plan.predicted_ms_per_token > halda.solve(roomy, model).predicted_ms_per_token


def test_halda_uses_an_accelerator_that_is_faster(make_device, make_model):
    model = make_model(n_layers=8, layer_mib=100)
    gpu = AcceleratorProfile(
        "cuda", memory_available_bytes=4 << 30, flops={"F32": 500e9}, mem_bandwidth_bytes_per_s=400e9
    )
    plan = halda.solve([make_device("head", ram_gib=8.0, accel=gpu)], model)
    assert plan.head.accel_layers == plan.head.window_size == 8


def test_halda_reports_an_unfittable_model(make_device, make_model):
    model = make_model(n_layers=8, layer_mib=400)
    devices = [make_device("a", ram_gib=0.5, disk_gbps=0.0), make_device("b", ram_gib=0.5, disk_gbps=0.0)]
    with pytest.raises(PlanError, match="add a device"):
        halda.solve(devices, model)


def test_halda_rejects_duplicate_node_ids(make_device, make_model):
    with pytest.raises(PlanError, match="duplicate"):
        halda.solve([make_device("a"), make_device("a")], make_model())


@pytest.mark.parametrize("ram_gib", [0.03, 0.04])
def test_halda_keeps_fewer_hops_when_link_latency_dominates(ram_gib: float) -> None:
    """Three small devices, none of which holds the whole small model (as in bench_wifi.py with
    --budgets): over loopback (0.2 ms) Halda splits the layers across devices; over the seeds'
    Wi-Fi (7 ms a hop) fewer hops a token win, even if a device must reread layers from disk,
    and Halda takes them. Its Wi-Fi plan beats the loopback layout costed on Wi-Fi."""
    model = dataclasses.replace(
        make_model(n_layers=30, layer_mib=2.1, kv_mib=0.05, ctx_tokens=512),
        input_bytes=8 * MiB,
        output_bytes=8 * MiB,
    )

    def cluster(latency_ms: float) -> list:
        return [
            make_device(
                f"d{i}", ram_gib=ram_gib, gflops=30, disk_gbps=5.0, latency_ms=latency_ms, net_mbps=400
            )
            for i in range(3)
        ]

    def hops(plan: Plan) -> int:
        return plan.rounds * len(plan.nodes) if len(plan.nodes) > 1 else 0

    near = halda.solve(cluster(0.2), model)
    far = halda.solve(cluster(7.0), model)
    assert len(near.nodes) > 1
    assert hops(far) < hops(near)
    kept = {n.node_id for n in near.nodes}
    wifi_kept = [d for d in cluster(7.0) if d.node_id in kept]
    near_layout_on_wifi = predict_ms_per_token(
        wifi_kept, model, near.rounds, [w.n_layers for n in near.nodes for w in n.windows[:1]]
    )
    assert far.predicted_ms_per_token < near_layout_on_wifi
