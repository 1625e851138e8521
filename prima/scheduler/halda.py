"""Halda: choose which devices join the ring and how many layers each computes a token.

For every k (rounds) the fastest assignment under `cost_model` is found exactly; the best k
wins. The objective (docs/halda.md has the derivation):

    minimize  T = max( kappa + sum_m (a_m t_m + b_m N_m + c_m H_m),     the trip round the ring
                       max_m d_m y_m + a_m t_m + b_m N_m + c_m H_m )      each device's own time
    subject to  sum_m t_m = L (device m's t_m layers in k windows of t_m // k or one more,
                H_m of them not empty, N_m of their layers on its accelerator), each device's
                layers fitting its memory (resident, or streaming: pinning what fits and
                rereading y_m layers per token), the accelerator layers fitting its accelerator
                memory, the layers it lacks fitting its disk budget, the head always in the ring.
    of equally fast plans: the fewest layers fetched (devices that hold only some), then the
    fewest rounds.

Where a device holds only part of the model, the windows' offsets matter, and k divides L with
every device's windows equal (t_m = k w_m), as in the original.

The trip is a sum over devices and each own time depends on one device alone, so for a bound
tau on the own times the cheapest trip is a knapsack over devices, solved by dynamic program;
`window_search` bisects tau over the own times the options can take. Which devices join, which
stream and how many layers go to accelerators are all choices inside that search, so unlike the
original (which fixes memory cases and drops devices by heuristics between solves) the result
is exact under the cost model; the tests check it against brute force.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prima.errors import PlanError
from prima.plan import DroppedDevice, Plan, plan_from_layer_counts
from prima.scheduler.cost_model import (
    DeviceCost,
    fetch_room_layers,
    pinned_layers,
    ring_costs,
    ring_time_of_counts,
)
from prima.scheduler.halda_fit import closest_fit
from prima.scheduler.halda_fit import describe as describe_shortfall
from prima.scheduler.layer_capacity import capacity
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile
from prima.scheduler.window_search import Coefficients, search, search_counts

log = logging.getLogger("prima.scheduler")

GiB = float(1 << 30)
MiB = float(1 << 20)
# Two plans whose predicted times differ by less than this are equally good; prefer fewer rounds.
_TIE_RELATIVE = 1e-9


@dataclass(frozen=True)
class Assignment:
    """The best plan for one k: the chosen devices (indices into the input, head first), the
    layers each computes a token (in windows of a size or one more, prima.plan.split_layers),
    their accelerator layers per window, the predicted ms per token, and how many layers the
    members must fetch because they do not hold them."""

    rounds: int
    members: tuple[int, ...]
    layer_counts: tuple[int, ...]
    accel_layers: tuple[int, ...]
    ms_per_token: float
    fetched_layers: int = 0

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """Each member's largest window."""
        return tuple(-(-t // self.rounds) for t in self.layer_counts)

    def beats(self, other: Assignment | None) -> bool:
        """Faster; or as fast (within _TIE_RELATIVE) and fetching less; or equal in both and
        with fewer rounds."""
        if other is None:
            return True
        if self.ms_per_token < other.ms_per_token * (1 - _TIE_RELATIVE):
            return True
        if self.ms_per_token > other.ms_per_token * (1 + _TIE_RELATIVE):
            return False
        return (self.fetched_layers, self.rounds) < (other.fetched_layers, other.rounds)


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
        raise PlanError(_no_fit_message(devices, model, costs, max_rounds))
    dropped = [
        DroppedDevice(devices[m].node_id, _drop_reason(costs, model.n_layers, best, m))
        for m in range(len(devices))
        if m not in best.members
    ]
    for d in dropped:
        log.info("dropped %s: %s", d.node_id, d.reason)
    return plan_from_layer_counts(
        [(devices[m].node_id, devices[m].address) for m in best.members],
        best.layer_counts,
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
    """The fastest assignment over every k up to `max_rounds`, or None; of equally fast plans,
    the one fetching fewest layers, then the one with fewer rounds. Where every device holds
    the whole model, a device's layers a token are any count (`solve_counts`); where some hold
    only part of it, which layers a window covers matters and k divides the layers, each
    device's windows equal (`solve_rounds`)."""
    coef = Coefficients.of(costs, n_layers)
    if not coef.any_partial:
        return _best_of_counts(costs, n_layers, coef, max_rounds)
    ks = [k for k in divisors(n_layers) if max_rounds is None or k <= max_rounds]
    # A bound from the coefficients alone orders the k: the likely best is searched first, and
    # its time then cuts the others short or rules them out before any search.
    bounds = sorted((_cheap_bound(costs, n_layers, k), k) for k in ks)
    best: Assignment | None = None
    for bound, k in bounds:
        cutoff = math.inf
        if best is not None:
            # Only a plan that beats the incumbent can replace it: one as fast may, if the
            # incumbent fetches layers or has more rounds.
            tie = best.fetched_layers > 0 or k < best.rounds
            cutoff = best.ms_per_token * ((1 + _TIE_RELATIVE) if tie else (1 - _TIE_RELATIVE))
            if bound >= cutoff:
                continue
        found = solve_rounds(costs, n_layers, k, cutoff_ms=cutoff, coef=coef)
        if found is not None and found.beats(best):
            best = found
    return best


def _best_of_counts(
    costs: Sequence[DeviceCost], n_layers: int, coef: Coefficients, max_rounds: int | None
) -> Assignment | None:
    """`best_assignment` for devices that all hold the whole model: every k from 1 up, each
    search cut short by the best time so far (a later k must beat it, not tie)."""
    best: Assignment | None = None
    top = n_layers if max_rounds is None else min(max_rounds, n_layers)
    for k in range(1, top + 1):
        cutoff = math.inf if best is None else best.ms_per_token * (1 - _TIE_RELATIVE)
        found = solve_counts(costs, n_layers, k, cutoff_ms=cutoff, coef=coef)
        if found is not None and found.beats(best):
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
    costs: Sequence[DeviceCost],
    n_layers: int,
    rounds: int,
    *,
    cutoff_ms: float = math.inf,
    coef: Coefficients | None = None,
) -> Assignment | None:
    """The fastest assignment for a fixed k = `rounds`. Returns None when nothing fits or
    nothing beats `cutoff_ms`."""
    k = rounds
    found = search(coef or Coefficients.of(costs, n_layers), k, n_layers // k, cutoff_ms)
    if found is None:
        return None
    counts = [k * w for w in found.window_sizes]
    return _scored(costs, k, counts, found.accel_layers, found.fetched_layers)


def solve_counts(
    costs: Sequence[DeviceCost],
    n_layers: int,
    rounds: int,
    *,
    cutoff_ms: float = math.inf,
    coef: Coefficients | None = None,
) -> Assignment | None:
    """The fastest assignment for k = `rounds` when every device holds the whole model, a
    device's layers a token being any count (windows of a size or one more); None when
    nothing fits or beats `cutoff_ms`."""
    k = rounds
    found = search_counts(coef or Coefficients.of(costs, n_layers), k, n_layers, cutoff_ms)
    if found is None:
        return None
    return _scored(costs, k, found.window_sizes, found.accel_layers, found.fetched_layers)


def _scored(
    costs: Sequence[DeviceCost], rounds: int, counts: Sequence[int], accel: Sequence[int], fetched: int
) -> Assignment:
    """A search's answer (layers a token and accelerator layers per device, 0 for those left
    out) as an Assignment, scored by the cost model itself so the plan's prediction is the
    model's."""
    members = tuple(m for m, t in enumerate(counts) if t > 0)
    mine = tuple(counts[m] for m in members)
    on_accel = tuple(accel[m] for m in members)
    ms = ring_time_of_counts([costs[m] for m in members], rounds, mine, on_accel)
    assert math.isfinite(ms), (rounds, mine, on_accel)
    return Assignment(rounds, members, mine, on_accel, ms, fetched)


class DropCause(enum.Enum):
    """Which limit kept a device out of the best plan (`drop_cause`)."""

    NO_CPU = "no_cpu"  # no throughput measured for the model's formats
    UNREACHABLE = "unreachable"  # no network bandwidth to it
    NO_ROOM = "no_room"  # not even one layer fits its memory (and it cannot stream)
    DISK_BUDGET = "disk_budget"  # it may fetch no layer, and holds none where a window lies
    SLOWER = "slower"  # it could join, but the ring is as fast or faster without it


def drop_cause(cost: DeviceCost, rounds: int, n_layers: int) -> DropCause:
    """Why a device with coefficients `cost` is not in the best plan of `rounds` rounds over
    `n_layers` layers. The program considered every subset of devices, so leaving it out is
    optimal; this says which limit made it so (the first that applies)."""
    if not math.isfinite(cost.cpu_ms_per_layer):
        return DropCause.NO_CPU
    if not math.isfinite(cost.hop_ms):
        return DropCause.UNREACHABLE
    per_round = n_layers // rounds
    if capacity(cost, rounds, per_round).window(cost, per_round) < 1:
        return DropCause.NO_ROOM
    if cost.fetch_room_layers == 0 and cost.held_layers is not None and len(cost.held_layers) < n_layers:
        return DropCause.DISK_BUDGET
    return DropCause.SLOWER


def _drop_reason(costs: Sequence[DeviceCost], n_layers: int, best: Assignment, m: int) -> str:
    """Why device m is not in the best plan, in words a user can act on."""
    c = costs[m]
    k = best.rounds
    cause = drop_cause(c, k, n_layers)
    if cause is DropCause.NO_CPU:
        return "no CPU throughput measured; re-run `prima profile` on it"
    if cause is DropCause.UNREACHABLE:
        return "no network bandwidth to it; check that it is reachable"
    if cause is DropCause.NO_ROOM:
        disk = "" if c.can_stream else " and no disk to stream from"
        return (
            f"cannot hold a layer in {k} round(s): a layer with its KV cache needs "
            f"{c.layer_ram_bytes / MiB:.0f} MiB, it has {c.ram_budget_bytes / MiB:.0f} MiB free{disk}"
        )
    if cause is DropCause.DISK_BUDGET:
        held = ", ".join(map(str, sorted(c.held_layers or ()))) or "none"
        return (
            f"its --disk-budget leaves no room to fetch a layer, and the layers it holds ({held}) "
            "are not where a window of the best plan lies; raise its --disk-budget or free room on it"
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
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    costs: Sequence[DeviceCost],
    max_rounds: int | None = None,
) -> str:
    """Why no plan fits, naming the constraint that binds where it can (prima.scheduler.halda_fit)."""
    if not math.isfinite(costs[0].cpu_ms_per_layer):
        return (
            f"the head {devices[0].node_id} has no CPU throughput for this model's formats; "
            "re-run `prima profile` on it"
        )
    budgeted = [d for d, c in zip(devices, costs, strict=True) if c.fetch_room_layers >= 0]
    unbounded = [dataclasses.replace(c, fetch_room_layers=-1) for c in costs]
    if budgeted and best_assignment(unbounded, model.n_layers) is not None:
        rooms = ", ".join(
            f"{d.node_id} {fetch_room_layers(d, model, is_head=i == 0)} layer(s)"
            for i, d in enumerate(devices)
            if d in budgeted
        )
        return (
            f"no assignment of {model.n_layers} layers fits the disk budgets: the devices would have to "
            f"fetch layers they lack and have room for only {rooms} more; raise a --disk-budget, free "
            "room on one, or start a primad holding the whole model file"
        )
    ks = [k for k in divisors(model.n_layers) if max_rounds is None or k <= max_rounds]
    short = closest_fit(costs, model.n_layers, ks)
    if short is not None:
        return describe_shortfall(short, devices, model, costs)
    need = model.n_layers * costs[0].layer_ram_bytes + costs[0].fixed_bytes
    have = sum(
        d.ram_available_bytes + (d.accelerator.memory_available_bytes if d.accelerator else 0)
        for d in devices
    )
    return (
        f"no assignment of {model.n_layers} layers fits: the model needs {need / GiB:.1f} GiB with a "
        f"{model.ctx_tokens}-token KV cache and the {len(devices)} device(s) have {have / GiB:.1f} GiB free"
        f"{'' if any(c.can_stream for c in costs) else ' and no disk to stream from'}; add a device, free "
        "memory, or lower --ctx"
    )
