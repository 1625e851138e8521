"""The exact per-k search against the cost model it mirrors and against brute force per k,
including the incumbent cutoff that lets Halda skip most k, and with devices that hold only
some layers and have a disk budget."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from prima.errors import PlanError
from prima.scheduler import halda
from prima.scheduler.cost_model import device_time, member_time, ring_costs, ring_fetched_layers
from prima.scheduler.window_search import Coefficients, count_option_tables, option_tables
from tests.no_numba import env_without_numba
from tests.scheduler.halda_oracle import brute_force, brute_force_with_fetches


@pytest.mark.parametrize("seed", range(12))
def test_option_tables_equal_the_cost_model(seed, random_cluster):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    coef = Coefficients.of(costs, model.n_layers)
    for k in halda.divisors(model.n_layers):
        per_round = model.n_layers // k
        for sends in (True, False):
            path, disk = option_tables(coef, k, per_round, sends=sends)
            for m, w, n in itertools.product(
                range(len(costs)), range(1, per_round + 1), range(per_round + 1)
            ):
                t = device_time(costs[m], k, w, n, sends=sends) if n <= w else None
                if t is None or (n and not costs[m].has_accel):
                    assert path[m, w, n] == math.inf, (m, w, n)
                else:
                    # Bit for bit: the search must rank options exactly as the cost model does.
                    assert (path[m, w, n], disk[m, w, n]) == (t.path_ms, t.disk_ms), (m, w, n)


@pytest.mark.parametrize("seed", range(12))
def test_count_option_tables_equal_the_cost_model(seed, random_cluster):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    coef = Coefficients.of(costs, model.n_layers)
    n_layers = model.n_layers
    for k in range(1, n_layers + 1):
        for sends in (True, False):
            path, disk = count_option_tables(coef, k, n_layers, sends=sends)
            for m, t, n in itertools.product(range(len(costs)), range(1, n_layers + 1), range(n_layers + 1)):
                time = member_time(costs[m], k, t, n, sends=sends)
                if n >= path.shape[2]:  # past every window: no such option
                    assert time is None, (k, m, t, n)
                elif time is None:
                    assert path[m, t, n] == math.inf, (k, m, t, n)
                else:
                    # Bit for bit: the search must rank options exactly as the cost model does.
                    assert (path[m, t, n], disk[m, t, n]) == (time.path_ms, time.disk_ms), (k, m, t, n)


@pytest.mark.parametrize("seed", range(12))
def test_member_time_of_whole_windows_is_device_time(seed, random_cluster):
    devices, model = random_cluster(seed)
    for cost in ring_costs(devices, model):
        for k in halda.divisors(model.n_layers):
            for w in range(1, model.n_layers // k + 1):
                for n in range(w + 1):
                    assert member_time(cost, k, k * w, n) == device_time(cost, k, w, n)


@pytest.mark.parametrize("seed", range(100, 130))
def test_solve_rounds_matches_brute_force_for_every_k(seed, random_cluster):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    for k in halda.divisors(model.n_layers):
        expected = brute_force(costs, model.n_layers, ks=[k])
        found = halda.solve_rounds(costs, model.n_layers, k)
        if not math.isfinite(expected):
            assert found is None
            continue
        assert found is not None
        assert found.ms_per_token == pytest.approx(expected, rel=1e-9)
        # The cutoff prunes exactly the k that cannot beat it.
        assert halda.solve_rounds(costs, model.n_layers, k, cutoff_ms=expected * (1 - 1e-9)) is None
        again = halda.solve_rounds(costs, model.n_layers, k, cutoff_ms=expected * (1 + 1e-6))
        assert again is not None
        assert again.ms_per_token == pytest.approx(expected, rel=1e-9)


def test_search_sees_streaming_trade_offs(random_cluster):
    """Guard on the generator: some optima stream (own time above the trip), so the bisection
    over own times, not only the unbounded trip, is what the brute-force tests check."""
    streaming = 0
    for seed in range(100, 130):
        devices, model = random_cluster(seed)
        costs = ring_costs(devices, model)
        for k in halda.divisors(model.n_layers):
            found = halda.solve_rounds(costs, model.n_layers, k)
            if found is None:
                continue
            ring = [costs[m] for m in found.members]
            trip = costs[0].fixed_ms + sum(
                device_time(c, k, w, n, sends=len(ring) > 1).path_ms
                for c, w, n in zip(ring, found.window_sizes, found.accel_layers, strict=True)
            )
            streaming += found.ms_per_token > trip * (1 + 1e-9)
    assert streaming > 0


def with_holdings(devices, n_layers: int, seed: int, *, budgets: bool):
    """The same devices, each holding a random subset of the layers (some the whole file), and
    with `budgets` a random disk budget: room for 0 to n_layers more layers."""
    rng = np.random.default_rng(seed)
    out = []
    for d in devices:
        if rng.random() < 0.25:
            out.append(d)  # the whole file
            continue
        held = tuple(int(i) for i in np.flatnonzero(rng.random(n_layers) < 0.5))
        layer = 1 << 20
        held_bytes = len(held) * layer
        budget = held_bytes + int(rng.integers(0, n_layers + 1)) * layer if budgets else 0
        out.append(dataclasses.replace(d, held_layers=held, held_bytes=held_bytes, disk_budget_bytes=budget))
    return out


def one_mib_layers(model):
    return dataclasses.replace(model, layer_bytes=1 << 20)


@pytest.mark.parametrize("seed", range(200, 230))
def test_halda_respects_disk_budgets_like_brute_force(seed, random_cluster):
    """With random holdings and disk budgets the optimum is still brute force's: the budgets are
    part of what fits (`ring_time_ms` is inf past one), not a filter after the search."""
    devices, model = random_cluster(seed)
    model = one_mib_layers(model)  # the budgets above count 1 MiB layers
    devices = with_holdings(devices, model.n_layers, seed, budgets=True)
    costs = ring_costs(devices, model)
    expected, _ = brute_force_with_fetches(costs, model.n_layers)
    if not math.isfinite(expected):
        with pytest.raises(PlanError):
            halda.solve(devices, model)
        return
    plan = halda.solve(devices, model)
    assert plan.predicted_ms_per_token == pytest.approx(expected, rel=1e-9)
    ring = [costs[[d.node_id for d in devices].index(n.node_id)] for n in plan.nodes]
    assert ring_fetched_layers(ring, plan.rounds, [n.window_size for n in plan.nodes]) is not None


@pytest.mark.parametrize("seed", range(300, 330))
def test_halda_fetches_least_among_the_fastest_plans_when_nothing_streams(seed, random_cluster):
    """Where every device holds its layers resident, T is the trip, and the search's tie-break
    on layers fetched is exact: the least of any plan as fast."""
    devices, model = random_cluster(seed)
    model = one_mib_layers(model)  # small layers: everything fits in RAM
    devices = with_holdings(devices, model.n_layers, seed, budgets=False)
    costs = ring_costs(devices, model)
    expected = brute_force_with_fetches(costs, model.n_layers)
    best = halda.best_assignment(costs, model.n_layers)
    assert best is not None
    assert best.ms_per_token == pytest.approx(expected[0], rel=1e-9)
    assert best.fetched_layers == expected[1]


def test_halda_gives_identical_devices_the_layers_they_hold(make_device, make_model):
    """Two equal devices, neither able to hold all 12 layers (the head 7, the other 8): the plan
    is as fast whichever way they split, and each is given the layers it already holds."""
    model = make_model(n_layers=12, layer_mib=100)
    equal = {"ram_gib": 0.9, "disk_gbps": 0.0}
    head = dataclasses.replace(make_device("head", **equal), held_layers=tuple(range(7, 12)))
    other = dataclasses.replace(make_device("other", **equal), held_layers=tuple(range(7)))
    plan = halda.solve([head, other], model)
    assert plan.rounds == 1
    # The plan lays out the other node's window first, the head's last.
    assert [(n.node_id, n.windows[0].start, n.windows[0].end) for n in plan.nodes] == [
        ("head", 7, 12),
        ("other", 0, 7),
    ]


def test_halda_keeps_a_device_within_its_disk_budget(make_device, make_model):
    """The faster device holds nothing and has room for 2 layers: it takes 2, not the 8 it
    would take with room to spare, and the plan is slower for it."""
    model = make_model(n_layers=12, layer_mib=100)
    head = make_device("head", ram_gib=4.0, gflops=10.0)
    fast = make_device("fast", ram_gib=4.0, gflops=40.0)
    roomy = halda.solve([head, fast], model)
    budget = 2 * model.layer_bytes + model.layer_bytes // 2
    tight = dataclasses.replace(fast, held_layers=(), held_bytes=0, disk_budget_bytes=budget)
    plan = halda.solve([head, tight], model)
    assert {n.node_id: n.n_layers for n in roomy.nodes}["fast"] > 2
    assert {n.node_id: n.n_layers for n in plan.nodes} == {"head": 10, "fast": 2}
    assert plan.predicted_ms_per_token > roomy.predicted_ms_per_token


def test_halda_says_when_disk_budgets_are_what_does_not_fit(make_device, make_model):
    """The head also needs room for the embedding and output head (128 MiB here) it lacks."""
    model = make_model(n_layers=8, layer_mib=100)
    empty = {
        "held_layers": (),
        "holds_head_tensors": False,
        "held_bytes": 0,
        "disk_budget_bytes": 3 * model.layer_bytes,
    }
    devices = [dataclasses.replace(make_device(name), **empty) for name in ("a", "b")]
    with pytest.raises(
        PlanError, match=r"fits the disk budgets.*a 1 layer\(s\), b 3 layer\(s\).*--disk-budget"
    ):
        halda.solve(devices, model)


def test_halda_says_when_a_disk_budget_keeps_a_device_out(make_device, make_model):
    """Without the file and with no room to fetch a layer, a fast device cannot help."""
    model = make_model(n_layers=12, layer_mib=100)
    full = dataclasses.replace(
        make_device("full", gflops=80.0), held_layers=(), held_bytes=0, disk_budget_bytes=1
    )
    plan = halda.solve([make_device("head", ram_gib=4.0), full], model)
    assert [n.node_id for n in plan.nodes] == ["head"]
    (dropped,) = plan.dropped
    assert dropped.reason.startswith("its --disk-budget leaves no room to fetch a layer")


_SEARCH_CHILD = """
import json, sys
from prima.scheduler import halda
from prima.scheduler.cost_model import ring_costs
from tests.scheduler.conftest import random_cluster

assert sys.modules.get("numba") is None  # blocked: the search runs interpreted
found = []
for seed in json.loads(sys.argv[1]):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    for k in halda.divisors(model.n_layers):
        a = halda.solve_rounds(costs, model.n_layers, k)
        found.append(None if a is None else [list(a.members), list(a.window_sizes), list(a.accel_layers)])
print(json.dumps(found))
"""


def test_the_search_without_numba_finds_the_same_plans(tmp_path, random_cluster):
    """On a device without numba (a phone's coordinator) the search runs as plain Python: the
    same assignments as the compiled search, which the brute-force tests check."""
    seeds = list(range(100, 115))
    done = subprocess.run(
        [sys.executable, "-c", _SEARCH_CHILD, json.dumps(seeds)],
        env=env_without_numba(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = []
    for seed in seeds:
        devices, model = random_cluster(seed)
        costs = ring_costs(devices, model)
        for k in halda.divisors(model.n_layers):
            a = halda.solve_rounds(costs, model.n_layers, k)
            expected.append(
                None if a is None else [list(a.members), list(a.window_sizes), list(a.accel_layers)]
            )
    assert any(expected)
    assert json.loads(done.stdout) == expected
