"""The exact per-k search against the cost model it mirrors and against brute force per k,
including the incumbent cutoff that lets Halda skip most k."""

from __future__ import annotations

import itertools
import math

import pytest

from prima.scheduler import halda
from prima.scheduler.cost_model import device_time, ring_costs, ring_time_ms
from prima.scheduler.window_search import Coefficients, option_tables
from tests.scheduler.test_halda import compositions


def brute_force_rounds(costs, n_layers: int, k: int) -> float:
    """Minimum of `ring_time_ms` over every subset with the head, window and accelerator vector."""
    per_round = n_layers // k
    best = math.inf
    for r in range(min(len(costs), per_round)):
        for rest in itertools.combinations(range(1, len(costs)), r):
            ring = [costs[m] for m in (0, *rest)]
            for windows in compositions(per_round, len(ring)):
                choices = [
                    range(w + 1) if c.has_accel else range(1) for c, w in zip(ring, windows, strict=True)
                ]
                for accel in itertools.product(*choices):
                    best = min(best, ring_time_ms(ring, k, windows, accel))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_option_tables_equal_the_cost_model(seed, random_cluster):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    coef = Coefficients.of(costs)
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


@pytest.mark.parametrize("seed", range(100, 130))
def test_solve_rounds_matches_brute_force_for_every_k(seed, random_cluster):
    devices, model = random_cluster(seed)
    costs = ring_costs(devices, model)
    for k in halda.divisors(model.n_layers):
        expected = brute_force_rounds(costs, model.n_layers, k)
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
