"""Halda: choose which devices join the ring and how many layers each computes per round.

For every k dividing L (W = L/k layers per round) one small mixed-integer program is solved
with HiGHS; the best k wins. The objective and constraints are those of `cost_model`, written
linearly (docs/halda.md has the derivation):

    minimize  k * sum_m (a_m w_m + b_m n_m + d_m y_m + c_m z_m) + k c_0 h + kappa
    subject to
      sum_m w_m = W                              every layer of a round is computed somewhere
      z_m <= w_m <= wmax_m z_m                   z_m binary: device m is in the ring
      n_m <= w_m,  n_m <= nmax_m                 accelerator layers fit its memory
      u_m <= R_m + (S_m - R_m) s_m               s_m binary: device m streams from disk
      y_m >= u_m - S_m (1 - s_m),  y_m >= 0      y_m: layers it rereads every token
      h >= z_m  (m > 0)                          h binary: the head has a next hop

u_m are the layers whose weights sit in RAM (w_m - n_m, or w_m with unified memory); R_m is how
many of them fit resident and S_m how many fit when streaming (two windows + all KV). Memory
budgets are thus integer layer counts computed exactly from bytes, so the program's feasible
set is the cost model's, with no floating tolerance at the boundary.

The original system decides two things outside the program: each device's memory case (iterate
"solve, reassign cases" until stable) and which devices to drop (those left with one layer).
Both heuristics can stop short of the optimum, so here both are binaries inside it (s_m, z_m);
with the hop cost c_m measured, a device whose hop costs more than it saves is dropped by the
objective itself. The result is exact under the cost model; the tests check it against brute
force.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from prima.errors import PlanError
from prima.plan import DroppedDevice, Plan, plan_from_window_sizes
from prima.scheduler.cost_model import DeviceCost, pinned_layers, ring_costs, ring_time_ms
from prima.scheduler.profile import DeviceProfile, ModelProfile

log = logging.getLogger("prima.scheduler")

GiB = float(1 << 30)
MiB = float(1 << 20)
# Variables per device, in column order; two more columns, h and T, close the vector.
_W, _N, _Z, _S, _Y, _P = range(6)
_PER_DEVICE = 6
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


@dataclass(frozen=True)
class Capacity:
    """How many layers per window device m can take in k rounds (all counts per window)."""

    resident: int  # R: layers in RAM that fit resident, k u b' + fixed <= budget
    streaming: int  # S: layers in RAM that fit when streaming, or -1 if streaming cannot help
    accel: int  # nmax: layers the accelerator memory holds, k n b' <= accelerator memory

    @property
    def in_ram(self) -> int:
        return max(self.resident, self.streaming)

    def window(self, cost: DeviceCost, per_round: int) -> int:
        """wmax: the largest window the device can take at all."""
        if cost.accel_shares_ram or not cost.has_accel:
            return min(per_round, self.in_ram)
        return min(per_round, self.in_ram + self.accel) if self.in_ram >= 0 else -1


def capacity(cost: DeviceCost, rounds: int, per_round: int) -> Capacity:
    """Exact integer form of the cost model's memory rules for one device."""
    k = rounds
    room = cost.ram_budget_bytes - cost.fixed_bytes
    if room < 0:
        return Capacity(-1, -1, 0)
    resident = _fit(room, k * cost.layer_ram_bytes, per_round)
    streaming = -1
    if cost.can_stream:
        # Pinning nothing: all the KV cache plus a stream buffer of u + 1 layers.
        streaming = _fit(
            room - cost.layer_weight_bytes, k * cost.layer_kv_bytes + cost.layer_weight_bytes, per_round
        )
        if streaming <= resident:
            streaming = -1  # streaming lets it hold no more layers
    accel = _fit(cost.accel_budget_bytes, k * cost.layer_ram_bytes, per_round) if cost.has_accel else 0
    return Capacity(resident, streaming, accel)


def _fit(room: int, per_layer: int, cap: int) -> int:
    if room < 0:
        return -1
    return cap if per_layer <= 0 else min(cap, room // per_layer)


def solve(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    *,
    max_rounds: int | None = None,
    epoch: int = 1,
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
        DroppedDevice(devices[m].node_id, _drop_reason(costs, model.n_layers, best, m))
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
    """The fastest assignment over every k dividing `n_layers` (up to `max_rounds`), or None;
    equal plans prefer fewer rounds."""
    ks = [k for k in divisors(n_layers) if max_rounds is None or k <= max_rounds]
    # Bounds first: one from the coefficients alone rules some k out for free; each remaining
    # k's LP relaxation (about a millisecond) orders the integer programs, which are solved best
    # bound first, so the incumbent is found early and cuts the others short or rules them out.
    candidates = []
    for k in ks:
        built = _build_program(costs, n_layers, k)
        if built is None:
            continue
        lp = built.prog.to_lp(built.continuous)
        bound = max(_relaxation_bound(lp), _cheap_bound(costs, n_layers, k))
        if math.isfinite(bound):
            candidates.append((bound, k, built, lp))
    best: Assignment | None = None
    for bound, k, built, lp in sorted(candidates, key=lambda c: (c[0], c[1])):
        cutoff = math.inf
        if best is not None:
            # Only a better plan, or an equal one with fewer rounds, replaces the incumbent.
            tie = (1 + _TIE_RELATIVE) if k < best.rounds else (1 - _TIE_RELATIVE)
            cutoff = best.ms_per_token * tie
            if bound >= cutoff:
                continue
        found = built.decode(_solve_lp(lp, cutoff))
        if found is not None and found.ms_per_token < cutoff:
            best = found
    return best


def _cheap_bound(costs: Sequence[DeviceCost], n_layers: int, k: int) -> float:
    """A lower bound on T for k rounds from the coefficients alone: every layer at the fastest
    device's per-layer time; and unless the head holds every layer resident by itself, either k
    hops to a second device and back, or the head rereading from disk what it cannot pin."""
    head = costs[0]
    per_layer = min(c.cpu_ms_per_layer + min(c.accel_delta_ms_per_layer, 0.0) for c in costs)
    floor_ms = head.fixed_ms + n_layers * per_layer
    w = n_layers // k
    if capacity(head, k, w).resident < w:
        pinned = pinned_layers(head, k, w)
        alone = head.disk_ms_per_layer * (n_layers - pinned) if pinned >= 0 else math.inf
        hops = k * (head.hop_ms + min(c.hop_ms for c in costs[1:])) if len(costs) > 1 else math.inf
        floor_ms += min(alone, hops)
    return floor_ms


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def solve_rounds(
    costs: Sequence[DeviceCost], n_layers: int, rounds: int, *, cutoff_ms: float = math.inf
) -> Assignment | None:
    """Solve the integer program for a fixed k = `rounds`. Returns None when nothing fits or
    nothing beats `cutoff_ms`."""
    built = _build_program(costs, n_layers, rounds)
    if built is None:
        return None
    lp = built.prog.to_lp(built.continuous)
    if math.isfinite(cutoff_ms) and _relaxation_bound(lp) >= cutoff_ms:
        return None
    return built.decode(_solve_lp(lp, cutoff_ms))


@dataclass(frozen=True)
class _Built:
    """One k's integer program and how to read its solution back."""

    costs: Sequence[DeviceCost]
    rounds: int
    prog: _Program
    continuous: list[int]

    def decode(self, x: np.ndarray | None) -> Assignment | None:
        if x is None:
            return None
        m_count, k = len(self.costs), self.rounds
        members = tuple(m for m in range(m_count) if round(x[_PER_DEVICE * m + _Z]) == 1)
        windows = tuple(round(x[_PER_DEVICE * m + _W]) for m in members)
        accel = tuple(round(x[_PER_DEVICE * m + _N]) for m in members)
        # Score the answer with the cost model itself, so the plan's prediction is the model's.
        ms = ring_time_ms([self.costs[m] for m in members], k, windows, accel)
        assert math.isfinite(ms), (k, windows, accel)
        return Assignment(k, members, windows, accel, ms)


def _build_program(costs: Sequence[DeviceCost], n_layers: int, rounds: int) -> _Built | None:
    """The integer program for k = `rounds`, or None when the head cannot take a layer."""
    k = rounds
    per_round = n_layers // k
    m_count = len(costs)
    prog = _Program(_PER_DEVICE * m_count + 2)
    h, t = prog.n_cols - 2, prog.n_cols - 1

    def col(m: int, var: int) -> int:
        return _PER_DEVICE * m + var

    prog.var(t, 0, math.inf, 1.0)  # T, the objective
    trip: dict[int, float] = {t: 1}  # T - (the trip round the ring) >= kappa
    head_hop = costs[0].hop_ms
    if math.isfinite(head_hop) and m_count > 1:
        prog.var(h, 0, 1, 0.0)
        trip[h] = -k * head_hop
    for m, c in enumerate(costs):
        w, n, z, s, y, p = (col(m, v) for v in (_W, _N, _Z, _S, _Y, _P))
        cap = capacity(c, k, per_round)
        w_max = cap.window(c, per_round)
        usable = w_max >= 1 and math.isfinite(c.cpu_ms_per_layer) and (m == 0 or math.isfinite(c.hop_ms))
        if not usable:
            if m == 0:
                return None  # the head cannot take even one layer per window
            continue  # every column of m stays fixed at 0
        hop = 0.0 if m == 0 else k * c.hop_ms
        prog.var(z, 1 if m == 0 else 0, 1, 0.0)
        prog.var(w, 0, w_max, 0.0)
        prog.row({w: 1, z: -1}, 0, math.inf)  # z <= w
        prog.row({w: 1, z: -w_max}, -math.inf, 0)  # w <= wmax z
        if m > 0:
            prog.row({h: 1, z: -1}, 0, math.inf)  # h >= z_m
        own = {w: k * c.cpu_ms_per_layer, z: hop}  # this device's part of the trip
        u = {w: 1}
        if c.has_accel and cap.accel > 0:
            prog.var(n, 0, cap.accel, 0.0)
            prog.row({n: 1, w: -1}, -math.inf, 0)  # n <= w
            own[n] = k * c.accel_delta_ms_per_layer
            if not c.accel_shares_ram:
                u = {w: 1, n: -1}
        for j, v in own.items():
            trip[j] = trip.get(j, 0.0) - v
        if cap.streaming >= 0:
            _streaming_rows(
                prog, c, k, per_round, cap, u, own, s, y, p, t, head_hop if m == 0 and m_count > 1 else 0.0, h
            )
        else:
            prog.row(u, -math.inf, cap.resident)
    prog.row(trip, costs[0].fixed_ms, math.inf)
    prog.row({col(m, _W): 1 for m in range(m_count)}, per_round, per_round)
    # y and T may be continuous: at the optimum y equals an integer anyway.
    continuous = [col(m, _Y) for m in range(m_count)] + [t]
    return _Built(costs, k, prog, continuous)


def _streaming_rows(
    prog: _Program,
    c: DeviceCost,
    k: int,
    per_round: int,
    cap: Capacity,
    u: dict[int, int],
    own: dict[int, float],
    s: int,
    y: int,
    p: int,
    t: int,
    head_hop: float,
    h: int,
) -> None:
    """A device that may stream: s = 1 when it does, p its pinned layers, y the layers it rereads
    per token, and T >= its own time (reads + its part of the trip)."""
    # Big-M constants as small as the rows allow (a tighter LP relaxation, less branching):
    # u <= S always, and u <= R, p = 0 when s = 0.
    b = c.layer_weight_bytes
    most = k * cap.streaming  # k*u never exceeds this
    prog.var(s, 0, 1, 0.0)
    prog.var(p, 0, most, 0.0)
    prog.var(y, 0, most, 0.0)
    # u <= R + (S - R) s: resident, or streaming with the larger limit.
    prog.row({**u, s: -(cap.streaming - cap.resident)}, -math.inf, cap.resident)
    # Streaming: p*b + (k*KV + b)*u + b <= room (bytes); void when s = 0.
    room = c.ram_budget_bytes - c.fixed_bytes - b
    per_u = k * c.layer_kv_bytes + b
    big = max(0, per_u * cap.resident - room)
    mem = {p: float(b), s: float(big)}
    for j, v in u.items():
        mem[j] = mem.get(j, 0.0) + v * per_u
    prog.row(mem, -math.inf, room + big)
    prog.row({p: 1, s: -most}, -math.inf, 0)  # p <= k S s
    pin = {p: 1.0}
    for j, v in u.items():
        pin[j] = pin.get(j, 0.0) - k * v
    prog.row(pin, -math.inf, 0)  # p <= k u
    # y >= k u - p - k R (1 - s)
    reread = {y: 1.0, p: 1.0, s: -float(k * cap.resident)}
    for j, v in u.items():
        reread[j] = reread.get(j, 0.0) - k * v
    prog.row(reread, -float(k * cap.resident), math.inf)
    # T >= d y + own (the head's own time includes its hop to the next node, through h).
    row = {t: 1.0, y: -c.disk_ms_per_layer}
    for j, v in own.items():
        row[j] = row.get(j, 0.0) - v
    if head_hop:
        row[h] = row.get(h, 0.0) - k * head_hop
    prog.row(row, 0, math.inf)


class _Program:
    """A mixed-integer program built column by column and solved with HiGHS."""

    def __init__(self, n_cols: int) -> None:
        self.n_cols = n_cols
        self.cost = np.zeros(n_cols)
        self.lower = np.zeros(n_cols)
        self.upper = np.zeros(n_cols)  # unset columns are fixed at 0
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, j: int, lo: float, hi: float, cost: float) -> None:
        self.lower[j], self.upper[j], self.cost[j] = lo, hi, cost

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

    def to_lp(self, continuous: Sequence[int]) -> highspy.HighsLp:
        """The program as HiGHS takes it; `continuous` columns are real, the rest integer."""
        # Column-wise sparse matrix, as HiGHS takes it.
        by_col: list[list[tuple[int, float]]] = [[] for _ in range(self.n_cols)]
        for i, (coefs, _, _) in enumerate(self.rows):
            for j, v in coefs.items():
                by_col[j].append((i, float(v)))
        lp = highspy.HighsLp()
        lp.num_col_ = self.n_cols
        lp.num_row_ = len(self.rows)
        lp.col_cost_ = self.cost
        lp.col_lower_ = self.lower
        lp.col_upper_ = self.upper
        lp.row_lower_ = np.array([lo for _, lo, _ in self.rows], dtype=float)
        lp.row_upper_ = np.array([hi for _, _, hi in self.rows], dtype=float)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.cumsum([0] + [len(c) for c in by_col])
        lp.a_matrix_.index_ = np.array([i for c in by_col for i, _ in c], dtype=np.int32)
        lp.a_matrix_.value_ = np.array([v for c in by_col for _, v in c], dtype=float)
        integrality = [highspy.HighsVarType.kInteger] * self.n_cols
        for j in continuous:
            integrality[j] = highspy.HighsVarType.kContinuous
        lp.integrality_ = integrality
        return lp


def _solve_lp(lp: highspy.HighsLp, cutoff: float) -> np.ndarray | None:
    """Integer solution vector, or None if infeasible or no better than `cutoff`."""
    for attempt in range(2):
        solver = _new_highs()
        solver.setOptionValue("mip_rel_gap", 0.0)
        if math.isfinite(cutoff):
            solver.setOptionValue("objective_bound", cutoff)
        solver.passModel(lp)
        if solver.run() != highspy.HighsStatus.kError or attempt:
            break
        # HiGHS keeps one thread pool per process; if someone started it with other
        # settings, our single-threaded run is refused until the pool is rebuilt.
        log.debug("HiGHS refused to run; resetting its thread pool")
        highspy.Highs.resetGlobalScheduler(True)
    if solver.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return np.rint(np.asarray(solver.getSolution().col_value)).astype(int)


def _relaxation_bound(lp: highspy.HighsLp) -> float:
    """The LP relaxation's optimum: a lower bound on the program's, found in well under a
    millisecond; inf when even the relaxation is infeasible."""
    solver = _new_highs()
    solver.setOptionValue("solve_relaxation", True)
    # Presolve costs more than it saves on an LP this small (2.2 -> 1.0 ms at 32 devices); the
    # integer programs keep it, since branching without it is far slower.
    solver.setOptionValue("presolve", "off")
    solver.passModel(lp)
    if solver.run() == highspy.HighsStatus.kError:
        return -math.inf
    status = solver.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return math.inf
    if status != highspy.HighsModelStatus.kOptimal:
        return -math.inf
    return solver.getInfo().objective_function_value


_banner_silenced = False


def _new_highs() -> highspy.Highs:
    """A quiet HiGHS instance. The first one in a process writes a banner straight to fd 1,
    past sys.stdout, which would corrupt `prima plan --json`; point fd 1 at /dev/null for it."""
    global _banner_silenced
    if _banner_silenced:
        solver = highspy.Highs()
    else:
        sys.stdout.flush()
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            solver = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
        _banner_silenced = True
    solver.setOptionValue("output_flag", False)
    # These programs take a few hundred microseconds to solve; HiGHS's worker threads and its
    # feasibility-jump heuristic each cost ten times that to start, so run without both.
    solver.setOptionValue("threads", 1)
    solver.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    return solver


def _drop_reason(costs: Sequence[DeviceCost], n_layers: int, best: Assignment, m: int) -> str:
    """Why device m is not in the best plan, in words a user can act on. The program considered
    every subset of devices, so leaving m out is optimal; this says which limit made it so."""
    c = costs[m]
    k = best.rounds
    if not math.isfinite(c.cpu_ms_per_layer):
        return "no CPU throughput measured; re-run `prima profile` on it"
    if not math.isfinite(c.hop_ms):
        return "no network bandwidth to it; check that it is reachable"
    if capacity(c, k, n_layers // k).window(c, n_layers // k) < 1:
        disk = "" if c.can_stream else " and no disk to stream from"
        return (
            f"cannot hold a layer in {k} round(s): a layer with its KV cache needs "
            f"{c.layer_ram_bytes / MiB:.0f} MiB, it has {c.ram_budget_bytes / MiB:.0f} MiB free{disk}"
        )
    per_layer = c.cpu_ms_per_layer + min(c.accel_delta_ms_per_layer, 0.0)
    members = [costs[i] for i in best.members]
    hops = k * sum(x.hop_ms for x in members) if len(members) > 1 else 0.0
    ring_avg = (best.ms_per_token - costs[0].fixed_ms - hops) / n_layers
    return (
        f"faster without it: a layer takes {per_layer:.2f} ms on it vs {ring_avg:.2f} ms on average "
        f"in the ring, and it would add a {c.hop_ms:.1f} ms hop per round"
    )


def _no_fit_message(
    devices: Sequence[DeviceProfile], model: ModelProfile, costs: Sequence[DeviceCost]
) -> str:
    if not math.isfinite(costs[0].cpu_ms_per_layer):
        return (
            f"the head {devices[0].node_id} has no CPU throughput for this model's formats; "
            "re-run `prima profile` on it"
        )
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
