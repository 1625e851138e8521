"""The brute-force oracle Halda's tests compare against: every ring Halda may choose, enumerated,
each scored by the same cost model (`ring_time_ms`, `ring_time_of_counts`). Exponential; for
clusters of a few devices."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

from prima.scheduler import halda
from prima.scheduler.cost_model import DeviceCost, ring_fetched_layers, ring_time_ms, ring_time_of_counts

Candidate = tuple[list[DeviceCost], int, tuple[int, ...], tuple[int, ...]]  # ring, k, windows, accel


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as `parts` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def candidates(
    costs: Sequence[DeviceCost], n_layers: int, ks: Iterable[int] | None = None
) -> Iterator[Candidate]:
    """Every subset of the devices containing the head (`costs[0]`), every k dividing n_layers
    (or each of `ks`), every window vector of n_layers/k layers (at least one each) and every
    accelerator-layer vector (0 on devices without one)."""
    for k in halda.divisors(n_layers) if ks is None else ks:
        per_round = n_layers // k
        for r in range(min(len(costs), per_round)):
            for rest in itertools.combinations(range(1, len(costs)), r):
                ring = [costs[m] for m in (0, *rest)]
                for windows in compositions(per_round, len(ring)):
                    choices = [
                        range(w + 1) if c.has_accel else range(1) for c, w in zip(ring, windows, strict=True)
                    ]
                    for accel in itertools.product(*choices):
                        yield ring, k, windows, accel


def brute_force(costs: Sequence[DeviceCost], n_layers: int, ks: Iterable[int] | None = None) -> float:
    """Least predicted ms/token over `candidates`; inf when nothing fits."""
    return min((ring_time_ms(*c) for c in candidates(costs, n_layers, ks)), default=math.inf)


def brute_force_with_fetches(costs: Sequence[DeviceCost], n_layers: int) -> tuple[float, int]:
    """Least (ms/token, layers fetched) in that order over `candidates`; times within 1e-9
    count as equal."""
    best: tuple[float, int] = (math.inf, 0)
    for ring, k, windows, accel in candidates(costs, n_layers):
        t = ring_time_ms(ring, k, windows, accel)
        if not math.isfinite(t):
            continue
        fetched = sum(ring_fetched_layers(ring, k, windows))  # type: ignore[arg-type]
        if t < best[0] * (1 - 1e-9) or (t <= best[0] * (1 + 1e-9) and fetched < best[1]):
            best = (t, fetched)
    return best


def count_candidates(costs: Sequence[DeviceCost], n_layers: int) -> Iterator[Candidate]:
    """Every ring Halda may choose for devices that hold the whole model: every subset with
    the head, every k from 1 to n_layers, every split of the n_layers layers a token among the
    members (at least one each, any count) and every accelerator-layer vector (up to each
    member's largest window; 0 on devices without one)."""
    for k in range(1, n_layers + 1):
        for r in range(min(len(costs), n_layers)):
            for rest in itertools.combinations(range(1, len(costs)), r):
                ring = [costs[m] for m in (0, *rest)]
                for counts in compositions(n_layers, len(ring)):
                    choices = [
                        range(-(-t // k) + 1) if c.has_accel else range(1)
                        for c, t in zip(ring, counts, strict=True)
                    ]
                    for accel in itertools.product(*choices):
                        yield ring, k, counts, accel


def brute_force_counts(costs: Sequence[DeviceCost], n_layers: int) -> float:
    """Least predicted ms/token over `count_candidates`; inf when nothing fits."""
    return min((ring_time_of_counts(*c) for c in count_candidates(costs, n_layers)), default=math.inf)
