"""A device's layer capacity is the cost model's memory rules in integers: the largest window it
reports is the largest window `cost_model.device_time` lets the device hold (with any split of
that window between CPU and accelerator), for seeded random devices of every kind."""

from __future__ import annotations

import math
import random

import pytest

from prima.scheduler.cost_model import DeviceCost, device_time
from prima.scheduler.layer_capacity import capacity

MiB = 1 << 20
ROUNDS = (1, 2, 3, 4)
PER_ROUND = (1, 2, 5, 8)


def _random_cost(rng: random.Random, *, accel: str) -> DeviceCost:
    """A device with a few layers' worth of memory. `accel`: "none", "own" (its own memory),
    "in_place" (shares RAM, reads the CPU's pages) or "copies" (shares RAM, its own copies)."""
    weight, kv = rng.randint(1, 64) * MiB, rng.randint(0, 32) * MiB
    return DeviceCost(
        cpu_ms_per_layer=1.0,
        accel_delta_ms_per_layer=-0.5 if accel != "none" else 0.0,
        disk_ms_per_layer=rng.choice([math.inf, 3.0]),
        hop_ms=1.0,
        fixed_ms=0.0,
        layer_weight_bytes=weight,
        layer_kv_bytes=kv,
        fixed_bytes=rng.choice([0, rng.randint(1, 200) * MiB]),
        ram_budget_bytes=rng.randint(0, 40) * (weight + kv) // 4,
        accel_budget_bytes=0 if accel == "none" else rng.randint(1, 30) * (weight + kv) // 4,
        accel_shares_ram=accel in ("in_place", "copies"),
        accel_layer_bytes=rng.choice([0, rng.randint(1, 64) * MiB]),
        accel_copies_weights=accel == "copies",
    )


def _largest_window(cost: DeviceCost, rounds: int, per_round: int) -> int:
    """By brute force: the largest window up to `per_round` that the cost model lets fit, 0 if none."""
    fits = [
        w
        for w in range(1, per_round + 1)
        if any(device_time(cost, rounds, w, n) is not None for n in range(w + 1))
    ]
    return max(fits, default=0)


@pytest.mark.parametrize("accel", ["none", "own", "in_place"])
def test_capacity_window_is_the_largest_window_the_cost_model_fits(accel: str) -> None:
    rng = random.Random(f"layer-capacity-{accel}")
    for _ in range(300):
        cost = _random_cost(rng, accel=accel)
        for k in ROUNDS:
            for w in PER_ROUND:
                got = max(capacity(cost, k, w).window(cost, w), 0)
                assert got == _largest_window(cost, k, w), (cost, k, w)


def test_capacity_window_never_overstates_an_accelerator_keeping_copies_in_shared_ram() -> None:
    """An NPU on a SoC keeps its own copy of its layers in the RAM it shares: capacity counts
    every layer at its CPU size there, a bound the exact window search may beat but never misses."""
    rng = random.Random("layer-capacity-copies")
    for _ in range(300):
        cost = _random_cost(rng, accel="copies")
        for k in ROUNDS:
            for w in PER_ROUND:
                got = max(capacity(cost, k, w).window(cost, w), 0)
                assert got <= _largest_window(cost, k, w), (cost, k, w)
