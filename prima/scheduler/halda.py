"""Halda: choose which devices join the ring and how many layers each computes per round.

For every k dividing L (W = L/k layers per round) one small mixed-integer program is solved
with HiGHS; the best k wins. The objective and constraints are those of `cost_model`, written
linearly (see docs/halda.md for the derivation):

    minimize  k * sum_m (a_m w_m + b_m n_m + d_m y_m + c_m z_m) + k c_0 h + kappa

    w_m  integer, layers per window;  z_m <= w_m <= W z_m        (z_m: device m is in the ring)
    n_m  integer, accelerator layers; n_m <= w_m, k n_m b'_m <= accelerator memory
    s_m  binary, device m streams its layers from disk; y_m = u_m s_m its streamed layers
    h    binary, some device besides the head is in the ring (a lone head sends nothing)
    sum_m w_m = W

The original system decides two things outside the integer program: the memory case of each
device (by iterating "solve, reassign cases" until stable) and which devices to drop (those left
with a single layer). Both heuristics can stop short of the optimum, so here both decisions are
binaries inside the program (s_m and z_m); with the network cost c_m measured, a device whose
hop costs more than its layers save is dropped by the objective itself. The result is exact under
the cost model, which the tests check against brute-force enumeration.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from prima.errors import PlanError
from prima.scheduler.cost_model import DeviceCost, ring_costs, ring_time_ms
from prima.scheduler.plan import DroppedDevice, Plan, plan_from_window_sizes
from prima.scheduler.profile import DeviceProfile, ModelProfile

log = logging.getLogger("prima.scheduler")

GiB = float(1 << 30)
# Variables per device, in column order.
_W, _N, _Z, _S, _Y = range(5)
_PER_DEVICE = 5
# Two plans whose predicted times differ by less than this are equally good; prefer fewer rounds.
_TIE_RELATIVE = 1e-9


@dataclass(frozen=True)
class Assignment:
    """The solution of one integer program: the chosen devices (indices into the input, head
    first), their window sizes and accelerator layers, and the predicted ms per token."""

    rounds: int
    members: tuple[int, ...]
    window_sizes: tuple[int, ...]
    accel_layers: tuple[int, ...]
    ms_per_token: float


def solve(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    *,
    max_rounds: int | None = None,
    epoch: int = 1,
    explain_drops: bool = True,
) -> Plan:
    """Plan `model` over `devices` (devices[0] is the head and always stays in the ring).

    Returns the fastest plan under the cost model, with `predicted_ms_per_token` and, for every
    device left out, a `DroppedDevice` saying why. Raises PlanError when no assignment fits.
    """
    if not devices:
        raise PlanError("no devices to plan for; start primad on at least one device")
    ids = [d.node_id for d in devices]
    if len(set(ids)) != len(ids):
        raise PlanError(f"duplicate node ids {ids}; give every device a distinct node_id")
    costs = ring_costs(devices, model)
    best = best_assignment(costs, model.n_layers, max_rounds=max_rounds)
    if best is None:
        raise PlanError(_no_fit_message(devices, model, costs))
    dropped = [
        DroppedDevice(
            devices[m].node_id,
            _drop_reason(costs, model.n_layers, max_rounds or model.n_layers, best, m)
            if explain_drops
            else "",
        )
        for m in range(len(devices))
        if m not in best.members
    ]
    for d in dropped:
        log.info("dropped %s: %s", d.node_id, d.reason)
    return plan_from_window_sizes(
        [(devices[m].node_id, devices[m].address) for m in best.members],
        best.window_sizes,
        best.rounds,
        model.n_layers,
        accel_layers=best.accel_layers,
        epoch=epoch,
        predicted_ms_per_token=best.ms_per_token,
        dropped=dropped,
    )


def best_assignment(
    costs: Sequence[DeviceCost], n_layers: int, *, max_rounds: int | None = None
) -> Assignment | None:
    """The fastest assignment over every k dividing `n_layers` (up to `max_rounds`), or None."""
    best: Assignment | None = None
    for k in divisors(n_layers):
        if max_rounds is not None and k > max_rounds:
            break
        found = solve_rounds(costs, n_layers, k)
        if found is None:
            continue
        if best is None or found.ms_per_token < best.ms_per_token * (1 - _TIE_RELATIVE):
            best = found
    return best


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def solve_rounds(
    costs: Sequence[DeviceCost], n_layers: int, rounds: int, *, force: int | None = None
) -> Assignment | None:
    """Solve the integer program for a fixed k = `rounds`; `force` keeps that device in the ring.
    Returns None when nothing fits."""
    k = rounds
    per_round = n_layers // k
    m_count = len(costs)
    n_cols = _PER_DEVICE * m_count + 1  # + h
    h_col = n_cols - 1
    obj = np.zeros(n_cols)
    lower = np.zeros(n_cols)
    upper = np.zeros(n_cols)
    integrality = np.ones(n_cols)
    rows: list[tuple[dict[int, float], float, float]] = []

    def col(m: int, var: int) -> int:
        return _PER_DEVICE * m + var

    kappa = costs[0].fixed_ms
    obj[h_col] = k * costs[0].hop_ms if math.isfinite(costs[0].hop_ms) else 0.0
    upper[h_col] = 1.0 if m_count > 1 and math.isfinite(costs[0].hop_ms) else 0.0

    for m, c in enumerate(costs):
        usable = math.isfinite(c.cpu_ms_per_layer) and (m == 0 or math.isfinite(c.hop_ms))
        if m == 0 and not usable:
            return None
        w, n, z, s, y = (col(m, v) for v in (_W, _N, _Z, _S, _Y))
        # Window size, tied to membership: z <= w <= W z.
        upper[w] = per_round
        lower[z] = 1.0 if m == 0 or m == force else 0.0
        upper[z] = 1.0 if usable else 0.0
        obj[w] = k * c.cpu_ms_per_layer
        rows.append(({w: 1.0, z: -1.0}, 0.0, math.inf))
        rows.append(({w: 1.0, z: -float(per_round)}, -math.inf, 0.0))
        if m > 0:
            obj[z] = k * c.hop_ms if usable else 0.0
            rows.append(({h_col: 1.0, z: -1.0}, 0.0, math.inf))  # h >= z_m
        # Accelerator layers: n <= w, and k n b' <= accelerator memory (as a bound on n).
        if c.has_accel:
            upper[n] = min(per_round, math.floor(c.accel_budget_bytes / (k * c.layer_ram_bytes)))
            obj[n] = k * c.accel_delta_ms_per_layer
            rows.append(({n: 1.0, w: -1.0}, -math.inf, 0.0))
        # u = layers whose weights live in RAM, as coefficients over (w, n).
        u = {w: 1.0} if c.accel_shares_ram or not c.has_accel else {w: 1.0, n: -1.0}
        budget = (c.ram_budget_bytes - c.fixed_bytes) / GiB
        # Resident unless streaming: k u b' <= budget + big s.
        need = k * c.layer_ram_bytes / GiB
        big = need * per_round + abs(budget) + 1.0
        rows.append(({**_scale(u, need), s: -big}, -math.inf, budget))
        if c.can_stream:
            # Streaming keeps two windows plus all the KV: (2 lw + k kv) u <= budget + big (1 - s).
            window = (2 * c.layer_weight_bytes + k * c.layer_kv_bytes) / GiB
            big_w = window * per_round + abs(budget) + 1.0
            rows.append(({**_scale(u, window), s: big_w}, -math.inf, budget + big_w))
            # y >= u - W (1 - s): the streamed layers, each costing d_m (y's cost keeps it tight).
            upper[s] = 1.0
            upper[y] = per_round
            obj[y] = k * c.disk_ms_per_layer
            rows.append(({y: 1.0, **_scale(u, -1.0), s: -float(per_round)}, -float(per_round), math.inf))
    # Every layer of a round is computed somewhere.
    rows.append(({col(m, _W): 1.0 for m in range(m_count)}, float(per_round), float(per_round)))

    a = np.zeros((len(rows), n_cols))
    row_lo = np.empty(len(rows))
    row_hi = np.empty(len(rows))
    for i, (coefs, lo, hi) in enumerate(rows):
        for j, v in coefs.items():
            a[i, j] += v
        row_lo[i], row_hi[i] = lo, hi
    # y is continuous (it equals an integer at the optimum anyway).
    integrality[[col(m, _Y) for m in range(m_count)]] = 0
    result = milp(
        obj,
        integrality=integrality,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(a, row_lo, row_hi),
        options={"mip_rel_gap": 0.0},
    )
    if result.x is None:
        return None
    x = np.rint(result.x).astype(int)
    members = tuple(m for m in range(m_count) if x[col(m, _Z)] == 1)
    windows = tuple(int(x[col(m, _W)]) for m in members)
    accel = tuple(int(x[col(m, _N)]) for m in members)
    # Score the solution with the cost model itself, so the plan's prediction is the model's.
    t = ring_time_ms([costs[m] for m in members], k, windows, accel)
    if not math.isfinite(t):
        log.debug("k=%d: solver answer %s/%s does not fit under the cost model", k, windows, accel)
        return None
    assert abs(t - (result.fun + kappa)) <= 1e-6 * max(1.0, t), (t, result.fun + kappa)
    return Assignment(k, members, windows, accel, t)


def _scale(coefs: dict[int, float], factor: float) -> dict[int, float]:
    return {j: v * factor for j, v in coefs.items()}


def _drop_reason(
    costs: Sequence[DeviceCost], n_layers: int, max_rounds: int, best: Assignment, m: int
) -> str:
    """Why device m is not in the best plan, for the user: unusable, too small, or too slow."""
    c = costs[m]
    if not math.isfinite(c.cpu_ms_per_layer):
        return "no CPU throughput measured; re-run `prima profile` on it"
    if not math.isfinite(c.hop_ms):
        return "no network bandwidth to it; check that it is reachable"
    forced = [solve_rounds(costs, n_layers, k, force=m) for k in divisors(n_layers) if k <= max_rounds]
    options = [a for a in forced if a is not None]
    if not options:
        one_layer = c.layer_ram_bytes / (1 << 20)
        return (
            f"cannot hold a layer: one layer with its KV cache needs {one_layer:.0f} MiB, "
            f"it has {c.ram_budget_bytes / (1 << 20):.0f} MiB free"
        )
    with_it = min(options, key=lambda a: a.ms_per_token)
    return (
        f"slower with it: the best plan including it takes {with_it.ms_per_token:.1f} ms/token vs "
        f"{best.ms_per_token:.1f} without (its hop costs {c.hop_ms:.1f} ms per round)"
    )


def _no_fit_message(
    devices: Sequence[DeviceProfile], model: ModelProfile, costs: Sequence[DeviceCost]
) -> str:
    need = model.n_layers * costs[0].layer_ram_bytes + costs[0].fixed_bytes
    have = sum(
        d.ram_available_bytes + (d.accelerator.memory_available_bytes if d.accelerator else 0)
        for d in devices
    )
    return (
        f"no assignment of {model.n_layers} layers fits: the model needs {need / GiB:.1f} GiB with a "
        f"{model.ctx_tokens}-token KV cache and the {len(devices)} device(s) have {have / GiB:.1f} GiB free "
        "and no disk fast enough to stream from; add a device, free memory, or lower --ctx"
    )
