"""The exact search for one k (rounds): which devices join and how many layers each computes.

The cost model's T is max(trip, each streaming device's own time); the trip is a sum over the
ring and each own time depends on one device's window only. So for a threshold tau on the own
times, the cheapest trip with every own time <= tau is a knapsack over devices (a dynamic
program over "layers given out so far", O(M W^2) for M devices and W = L/k layers per round),
and T* = min over tau of max(tau, F(tau)). F only changes at the own times of the options
themselves, and it falls as tau rises, so a bisection over those values (median first) needs
log2 of their number of dynamic programs. A device that does not stream has own time = its part
of the trip <= the trip, so only streaming options give thresholds.

Devices that hold only some layers: which layers a window covers depends on its offset in the
round, the program's state, so the layers a device would fetch are known at each step; a step
past its disk budget is not taken, and the program carries the layers fetched as a tie-break
beside the trip (docs/halda.md, "What devices hold").

The per-option times mirror `cost_model.device_time` exactly (the tests compare every entry);
numba runs the loops, which in Python would take seconds at 32 devices; without numba (a device
where it does not install) they run as plain Python, slower but the same search.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

import prima.kernels  # noqa: F401  (points numba's cache at prima's before anything is compiled)
from prima.scheduler.cost_model import DeviceCost

_F = TypeVar("_F", bound=Callable[..., object])

try:
    from numba import njit
except ImportError:  # the numpy fallback: the same functions, interpreted

    def njit(*_args: object, **_kwargs: object) -> Callable[[_F], _F]:
        return lambda fn: fn


INF = math.inf
# Times this close (relative) are equal: sums of the same terms in another order differ by ulps,
# and then the plan that fetches less wins.
TIE = 1e-12


@dataclass(frozen=True)
class Found:
    """The best assignment for one k: window sizes and accelerator layers per device (0 when it
    is left out; devices[0] always has a window), and its T as the search scored it."""

    window_sizes: tuple[int, ...]
    accel_layers: tuple[int, ...]
    ms_per_token: float
    fetched_layers: int  # layers the devices must fetch for it, all together


@dataclass(frozen=True)
class Coefficients:
    """The cost model's per-device coefficients as arrays, the form the compiled search takes."""

    cpu_ms: np.ndarray
    accel_delta_ms: np.ndarray
    disk_ms: np.ndarray
    hop_ms: np.ndarray
    layer_weight_bytes: np.ndarray
    layer_kv_bytes: np.ndarray
    fixed_bytes: np.ndarray
    ram_budget_bytes: np.ndarray
    accel_budget_bytes: np.ndarray
    accel_shares_ram: np.ndarray
    accel_layer_bytes: np.ndarray  # e_m, one layer on the accelerator
    accel_copies_weights: np.ndarray
    fixed_ms: float
    missing_before: np.ndarray  # [m, i]: layers below i that device m does not hold
    fetch_room: np.ndarray  # layers device m may fetch (a large number without a disk budget)
    any_partial: bool

    @classmethod
    def of(cls, costs: Sequence[DeviceCost], n_layers: int) -> Coefficients:
        def f64(name: str) -> np.ndarray:
            return np.array([getattr(c, name) for c in costs], dtype=np.float64)

        def i64(name: str) -> np.ndarray:
            return np.array([getattr(c, name) for c in costs], dtype=np.int64)

        return cls(
            f64("cpu_ms_per_layer"),
            f64("accel_delta_ms_per_layer"),
            f64("disk_ms_per_layer"),
            f64("hop_ms"),
            i64("layer_weight_bytes"),
            i64("layer_kv_bytes"),
            i64("fixed_bytes"),
            i64("ram_budget_bytes"),
            i64("accel_budget_bytes"),
            np.array([c.accel_shares_ram for c in costs], dtype=np.bool_),
            np.array([c.accel_bytes_per_layer for c in costs], dtype=np.int64),
            np.array([c.accel_copies_weights for c in costs], dtype=np.bool_),
            float(costs[0].fixed_ms),
            np.array([_missing_before(c, n_layers) for c in costs], dtype=np.int64),
            np.array(
                [c.fetch_room_layers if c.fetch_room_layers >= 0 else n_layers for c in costs], dtype=np.int64
            ),
            any(c.held_layers is not None for c in costs),
        )

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self.cpu_ms,
            self.accel_delta_ms,
            self.disk_ms,
            self.hop_ms,
            self.layer_weight_bytes,
            self.layer_kv_bytes,
            self.fixed_bytes,
            self.ram_budget_bytes,
            self.accel_budget_bytes,
            self.accel_shares_ram,
            self.accel_layer_bytes,
            self.accel_copies_weights,
        )


def _missing_before(cost: DeviceCost, n_layers: int) -> list[int]:
    held = cost.held_layers
    missing = [0 if held is None or i in held else 1 for i in range(n_layers)]
    return [0, *itertools.accumulate(missing)]


def option_tables(
    coef: Coefficients, rounds: int, per_round: int, *, sends: bool
) -> tuple[np.ndarray, np.ndarray]:
    """path[m, w, n] and disk[m, w, n] (ms) of device m with window w and n accelerator layers,
    as `cost_model.device_time` gives them; path is inf where the option does not fit."""
    return _tables(coef.arrays(), rounds, per_round, sends)


def search(coef: Coefficients, rounds: int, per_round: int, cutoff_ms: float = INF) -> Found | None:
    """The fastest assignment of `per_round` layers per round for k = `rounds`, or None when
    nothing fits or nothing is faster than `cutoff_ms`. Of plans equally fast (within rounding)
    that the search meets, the one fetching fewest layers wins."""
    path, disk = _tables(coef.arrays(), rounds, per_round, True)
    fetch = (coef.missing_before, coef.fetch_room, rounds, coef.any_partial)
    best, fetched, windows, accel = _search_ring(path, disk, *fetch, coef.fixed_ms, cutoff_ms)
    head = tuple(x[:1] for x in coef.arrays())
    alone_path, alone_disk = _tables(head, rounds, per_round, False)
    alone, n_alone = _alone(alone_path[0, per_round], alone_disk[0, per_round], coef.fixed_ms)
    alone_fetched = _fetched(coef.missing_before, 0, 0, per_round, per_round, rounds)
    if alone_fetched > coef.fetch_room[0]:
        alone = INF
    # On a tie the lone head wins (no hop to make) unless it would fetch more.
    if alone < cutoff_ms and (
        alone < best * (1 - TIE) or (alone <= best * (1 + TIE) and alone_fetched <= fetched)
    ):
        windows = np.zeros(len(coef.cpu_ms), dtype=np.int64)
        accel = np.zeros(len(coef.cpu_ms), dtype=np.int64)
        windows[0], accel[0], best, fetched = per_round, n_alone, alone, alone_fetched
    if not best < cutoff_ms:
        return None
    return Found(tuple(int(w) for w in windows), tuple(int(n) for n in accel), float(best), int(fetched))


def count_option_tables(
    coef: Coefficients, rounds: int, n_layers: int, *, sends: bool
) -> tuple[np.ndarray, np.ndarray]:
    """path[m, t, n] and disk[m, t, n] (ms) of device m computing t layers a token over k =
    `rounds` rounds, n of each window on its accelerator, as `cost_model.member_time` gives
    them; path is inf where the option does not fit."""
    return _count_tables(coef.arrays(), rounds, n_layers, sends)


def search_counts(coef: Coefficients, rounds: int, n_layers: int, cutoff_ms: float = INF) -> Found | None:
    """The fastest assignment of layers a token to devices for k = `rounds` rounds, each
    device's windows differing by at most a layer between rounds, so its share need not be a
    multiple of k; None when nothing fits or beats `cutoff_ms`. For devices that hold the whole
    model: which layers a window covers then does not matter. `Found.window_sizes` holds the
    layers a token here."""
    if coef.any_partial:
        raise ValueError("search_counts plans devices that hold the whole model; use search")
    path, disk = _count_tables(coef.arrays(), rounds, n_layers, True)
    best, fetched, counts, accel = _search_ring(
        path, disk, coef.missing_before, coef.fetch_room, rounds, False, coef.fixed_ms, cutoff_ms
    )
    alone_path, alone_disk = _alone_options(coef.arrays(), rounds, n_layers)
    alone, n_alone = _alone(alone_path, alone_disk, coef.fixed_ms)
    if alone < cutoff_ms and alone <= best * (1 + TIE):
        counts = np.zeros(len(coef.cpu_ms), dtype=np.int64)
        accel = np.zeros(len(coef.cpu_ms), dtype=np.int64)
        counts[0], accel[0], best = n_layers, n_alone, alone
    if not best < cutoff_ms:
        return None
    return Found(tuple(int(t) for t in counts), tuple(int(n) for n in accel), float(best), int(fetched))


@njit(cache=True)
def _option(coefs, m, k, t, n, h):
    """(path, disk) of device m computing t layers a token over k rounds with n layers of each
    window on its accelerator, as `cost_model.member_time` gives them (the same operations in
    the same order, so the same floats); path is inf when the option does not fit. `coefs` is
    `Coefficients.arrays()`."""
    a, b, d, _, lw, kv, fixed, ram, accel_budget, shares, accel_bytes, copies = coefs
    q, extra = divmod(t, k)
    acc = min(n, q) * (k - extra) + min(n, q + 1) * extra
    in_place = shares[m] and not copies[m]
    held = t if in_place else t - acc
    largest = 0
    if k - extra > 0:
        largest = q if in_place else q - min(n, q)
    if extra > 0:
        largest = max(largest, q + 1 if in_place else q + 1 - min(n, q + 1))
    if n > 0 and acc * accel_bytes[m] > accel_budget[m]:
        return np.inf, 0.0
    accel_ram = acc * accel_bytes[m] if shares[m] and copies[m] else 0
    reread = 0.0
    if held * (lw[m] + kv[m]) + fixed[m] + accel_ram > ram[m]:  # streams: pins what fits, rereads the rest
        room = ram[m] - fixed[m] - accel_ram - held * kv[m] - (largest + 1) * lw[m]
        if not math.isfinite(d[m]) or room < 0:
            return np.inf, 0.0
        pinned = held if lw[m] <= 0 else min(held, room // lw[m])
        reread = d[m] * (held - pinned)
    return a[m] * t + b[m] * acc + h * min(k, t), reread


@njit(cache=True)
def _tables(coefs, k, per_round, sends):
    """path[m, w, n], disk[m, w, n]: a window of w layers in every round (k * w layers a token)."""
    hop, accel_budget, accel_bytes = coefs[3], coefs[8], coefs[10]
    m_count = hop.shape[0]
    size = per_round + 1
    path = np.full((m_count, size, size), np.inf)
    disk = np.zeros((m_count, size, size))
    for m in range(m_count):
        h = hop[m] if sends else 0.0
        n_top = per_round if accel_budget[m] > 0 else 0
        for w in range(1, size):
            for n in range(min(w, n_top) + 1):
                if n > 0 and k * n * accel_bytes[m] > accel_budget[m]:
                    break
                p, r = _option(
                    coefs,
                    m,
                    k,
                    k * w,
                    n,
                    h,
                )
                path[m, w, n] = p
                disk[m, w, n] = r
    return path, disk


@njit(cache=True)
def _count_tables(coefs, k, n_layers, sends):
    """path[m, t, n], disk[m, t, n]: t layers a token in windows of t // k or one more layers
    (prima.plan.split_layers), n of each on the accelerator (n up to the largest window)."""
    hop, accel_budget, accel_bytes = coefs[3], coefs[8], coefs[10]
    m_count = hop.shape[0]
    size = n_layers + 1
    # n runs up to the largest window, ceil(t / k): only as wide as needed (one column without
    # accelerators), as every k is searched and each fills these tables.
    width = (n_layers + k - 1) // k + 1 if np.any(accel_budget > 0) else 1
    path = np.full((m_count, size, width), np.inf)
    disk = np.zeros((m_count, size, width))
    for m in range(m_count):
        h = hop[m] if sends else 0.0
        for t in range(1, size):
            n_top = (t + k - 1) // k if accel_budget[m] > 0 else 0
            q, extra = divmod(t, k)
            for n in range(n_top + 1):
                if (
                    n > 0
                    and (min(n, q) * (k - extra) + min(n, q + 1) * extra) * accel_bytes[m] > accel_budget[m]
                ):
                    break  # more accelerator layers than its memory holds, and so for every larger n
                p, r = _option(coefs, m, k, t, n, h)
                path[m, t, n] = p
                disk[m, t, n] = r
    return path, disk


@njit(cache=True)
def _alone_options(coefs, k, n_layers):
    """path[n], disk[n] of the head alone with all n_layers layers (no hop), as _count_tables."""
    n_top = (n_layers + k - 1) // k if coefs[8][0] > 0 else 0
    path = np.full(n_top + 1, np.inf)
    disk = np.zeros(n_top + 1)
    for n in range(n_top + 1):
        path[n], disk[n] = _option(
            coefs,
            0,
            k,
            n_layers,
            n,
            0.0,
        )
    return path, disk


@njit(cache=True)
def _alone(path, disk, fixed_ms):
    """The head alone with all W layers: T = max(kappa + path, disk + path), best over n."""
    best = np.inf
    best_n = 0
    for n in range(path.shape[0]):
        t = max(fixed_ms + path[n], disk[n] + path[n])
        if t < best:
            best, best_n = t, n
    return best, best_n


@njit(cache=True)
def _fetched(missing_before, m, offset, window, per_round, rounds):
    """Layers device m lacks in its windows at `offset` of every round."""
    n = 0
    for r in range(rounds):
        at = r * per_round + offset
        n += missing_before[m, at + window] - missing_before[m, at]
    return n


@njit(cache=True)
def _better(t, x, best_t, best_x):
    """(time, fetched) beats the best so far: clearly faster, or as fast and fetching less."""
    if not t < np.inf:
        return False
    return t < best_t * (1 - TIE) or (t <= best_t * (1 + TIE) and x < best_x)


@njit(cache=True)
def _cheapest_trip(path, disk, missing_before, fetch_room, rounds, any_partial, tau):
    """F(tau) without kappa: the least sum of path over assignments whose streaming options all
    have own time <= tau and whose fetches fit each disk budget (ties: the fewest layers
    fetched). Returns (trip, layers fetched, largest own time used, windows, accelerator layers).

    Windows lie in plan order, the head's last in each round, so the program runs over the
    other devices first with state "layers of the round given out so far" (the next window's
    offset), then closes with the head."""
    m_count, size = path.shape[0], path.shape[1]
    per_round = size - 1
    # Each device's cheapest allowed option per window size.
    best = np.full((m_count, size), np.inf)
    best_n = np.zeros((m_count, size), dtype=np.int64)
    for m in range(m_count):
        for w in range(1, size):
            for n in range(min(w, path.shape[2] - 1) + 1):
                p = path[m, w, n]
                if p < best[m, w] and (disk[m, w, n] == 0.0 or disk[m, w, n] + p <= tau):
                    best[m, w], best_n[m, w] = p, n
    dp = np.full(size, np.inf)
    dp_x = np.zeros(size, dtype=np.int64)
    dp[0] = 0.0
    choice = np.zeros((m_count, size), dtype=np.int64)
    for m in range(1, m_count):
        new = dp.copy()  # w = 0: m stays out
        new_x = dp_x.copy()
        for total in range(1, per_round):  # the head takes at least one layer
            for w in range(1, total + 1):
                at = total - w
                t = dp[at] + best[m, w]
                if not t < np.inf:
                    continue
                f = _fetched(missing_before, m, at, w, per_round, rounds) if any_partial else 0
                if f > fetch_room[m]:
                    continue
                if _better(t, dp_x[at] + f, new[total], new_x[total]):
                    new[total], new_x[total], choice[m, total] = t, dp_x[at] + f, w
        dp, dp_x = new, new_x
    trip, fetched, head_w = np.inf, 0, 0
    for w in range(1, size):
        at = per_round - w
        t = dp[at] + best[0, w]
        if not t < np.inf:
            continue
        f = _fetched(missing_before, 0, at, w, per_round, rounds) if any_partial else 0
        if f <= fetch_room[0] and _better(t, dp_x[at] + f, trip, fetched):
            trip, fetched, head_w = t, dp_x[at] + f, w
    windows = np.zeros(m_count, dtype=np.int64)
    accel = np.zeros(m_count, dtype=np.int64)
    own = -1.0
    if not trip < np.inf:
        return np.inf, 0, own, windows, accel
    windows[0] = head_w
    left = per_round - head_w
    for m in range(m_count - 1, 0, -1):
        windows[m] = choice[m, left]
        left -= windows[m]
    for m in range(m_count):
        w = windows[m]
        if w > 0:
            n = best_n[m, w]
            accel[m] = n
            if disk[m, w, n] > 0.0:
                own = max(own, disk[m, w, n] + path[m, w, n])
    return trip, fetched, own, windows, accel


@njit(cache=True)
def _search_ring(path, disk, missing_before, fetch_room, rounds, any_partial, fixed_ms, cutoff):
    """min over tau of max(tau, kappa + F(tau)) below `cutoff`, bisecting on the options' own
    times: each step either proves every larger tau worse (F(tau) fits under tau) or every
    smaller one (F(tau) is above tau, and F only grows as tau falls). Returns (T, layers
    fetched, windows, accelerator layers); T is inf when nothing beats `cutoff`."""
    m_count = path.shape[0]
    windows = np.zeros(m_count, dtype=np.int64)
    accel = np.zeros(m_count, dtype=np.int64)
    chosen, chosen_x = np.inf, 0
    bound = cutoff  # the least T seen: thresholds at or above it cannot help
    # The incumbent bounds first: the trip with no limit on own times is a lower bound on T.
    trip, x, own, w_t, n_t = _cheapest_trip(
        path, disk, missing_before, fetch_room, rounds, any_partial, np.inf
    )
    trip += fixed_ms
    if not trip < bound:
        return chosen, chosen_x, windows, accel
    g = max(trip, own)
    if g < cutoff:
        chosen, chosen_x, windows, accel = g, x, w_t, n_t
        bound = min(bound, g)
    if own <= trip:
        return chosen, chosen_x, windows, accel
    # Thresholds worth trying: "no streaming at all" (-1) and every streaming option's own time.
    taus = np.empty(path.size + 1)
    taus[0] = -1.0
    i = 1
    for m in range(m_count):
        for w in range(path.shape[1]):
            for n in range(path.shape[2]):
                if disk[m, w, n] > 0.0 and path[m, w, n] < np.inf:
                    taus[i] = disk[m, w, n] + path[m, w, n]
                    i += 1
    taus = taus[:i]
    lo = -np.inf
    while True:
        taus = taus[(taus > lo) & (taus < bound)]
        if taus.size == 0:
            return chosen, chosen_x, windows, accel
        tau = np.partition(taus, taus.size // 2)[taus.size // 2]
        trip, x, own, w_t, n_t = _cheapest_trip(
            path, disk, missing_before, fetch_room, rounds, any_partial, tau
        )
        trip += fixed_ms
        g = max(trip, own)
        if g < cutoff and _better(g, x, chosen, chosen_x):
            chosen, chosen_x, windows, accel = g, x, w_t, n_t
        bound = min(bound, g)
        if trip > tau:
            lo = tau  # every smaller tau has a trip at least this long
        # else bound <= max(trip, own) <= tau now: every larger tau is worse
