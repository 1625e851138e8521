"""Why no plan fits in memory: the constraint that binds, for Halda's error message.

For each number of rounds k, each device holds at most `Capacity.window` layers of a round's
W = L/k (resident, or streaming from disk with all its KV cache and a buffer of u + 1 layers),
and the head must hold at least one. When no k fits, the closest k is the one where the fewest
bytes of memory on a single device would close the gap; the message names that device, what
its memory would hold (output head, layers, KV cache, stream buffer) and the shortfall.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prima.scheduler.cost_model import DeviceCost, stream_buffer_layers
from prima.scheduler.layer_capacity import capacity
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile

MiB = float(1 << 20)


@dataclass(frozen=True)
class Shortfall:
    """Device `device` (an index; 0 is the head) would need `need_bytes` of memory, where it has
    `budget_bytes`, to hold `layers` layers per round in `rounds` rounds (streaming or not)."""

    device: int
    rounds: int
    layers: int
    need_bytes: int
    budget_bytes: int
    streaming: bool

    @property
    def short_bytes(self) -> int:
        return self.need_bytes - self.budget_bytes


def bytes_for(cost: DeviceCost, rounds: int, ram_layers: int) -> tuple[int, bool]:
    """(memory a device needs to hold `ram_layers` layers of each of `rounds` windows, whether
    that is by streaming): resident, every layer and its KV cache; streaming (with a disk), all
    the KV cache and a buffer of u + 1 layers, whichever is less (the cost model's rules)."""
    k, u = rounds, ram_layers
    resident = cost.fixed_bytes + k * u * cost.layer_ram_bytes
    if not cost.can_stream or u == 0:
        return resident, False
    streamed = (
        cost.fixed_bytes + k * u * cost.layer_kv_bytes + stream_buffer_layers(u) * cost.layer_weight_bytes
    )
    return (streamed, True) if streamed < resident else (resident, False)


def closest_fit(costs: Sequence[DeviceCost], n_layers: int, ks: Sequence[int]) -> Shortfall | None:
    """The smallest memory shortfall on one device that would let some k in `ks` cover every
    layer (other devices holding what they can), or None if memory is not what binds."""
    best: Shortfall | None = None
    for k in ks:
        per_round = n_layers // k
        held = [_window(c, k, per_round) for c in costs]
        usable = [m == 0 or _can_compute(c) for m, c in enumerate(costs)]
        total = sum(w for w, ok in zip(held, usable, strict=True) if ok)
        if held[0] >= 1 and total >= per_round:
            return None  # memory fits at this k: something else binds
        for m, cost in enumerate(costs):
            if not usable[m]:
                continue
            others = total - held[m]
            want = max(per_round - others, 1 if m == 0 else 0, held[m] + 1)
            if m != 0 and held[0] < 1:
                continue  # only the head can give the head room
            want = min(want, per_round)
            accel = capacity(cost, k, per_round).accel if cost.has_accel and not cost.accel_shares_ram else 0
            need, streaming = bytes_for(cost, k, max(want - accel, 0))
            found = Shortfall(m, k, want, need, cost.ram_budget_bytes, streaming)
            if best is None or found.short_bytes < best.short_bytes:
                best = found
    return best


def _window(cost: DeviceCost, rounds: int, per_round: int) -> int:
    return max(capacity(cost, rounds, per_round).window(cost, per_round), 0)


def _can_compute(cost: DeviceCost) -> bool:
    return math.isfinite(cost.cpu_ms_per_layer) and math.isfinite(cost.hop_ms)


def describe(
    short: Shortfall, devices: Sequence[DeviceProfile], model: ModelProfile, costs: Sequence[DeviceCost]
) -> str:
    """The shortfall in words: which device, its memory for what, and by how much."""
    cost = costs[short.device]
    name = devices[short.device].node_id
    who = f"the head {name}" if short.device == 0 else name
    k, w = short.rounds, short.layers
    parts = []
    if cost.fixed_bytes:
        what = "output head" + (" and draft model" if model.draft_bytes else "")
        parts.append(f"{cost.fixed_bytes / MiB:.0f} MiB for the {what}")
    parts.append(
        f"{k * w * cost.layer_kv_bytes / MiB:.0f} MiB of KV cache for its {k * w} layer(s) at {model.ctx_tokens} tokens"
    )
    if short.streaming:
        n = stream_buffer_layers(w)
        parts.append(
            f"{n * cost.layer_weight_bytes / MiB:.0f} MiB for {n} layer(s) streamed through from disk"
        )
    else:
        parts.append(f"{k * w * cost.layer_weight_bytes / MiB:.0f} MiB for its {k * w} layer(s), resident")
    plan = f"{k} round(s) of {model.n_layers // k} layer(s)"
    return (
        f"no assignment of {model.n_layers} layers fits in memory; the closest plan ({plan}) needs "
        f"{short.need_bytes / MiB:.0f} MiB on {who}: {', '.join(parts)}; it has "
        f"{short.budget_bytes / MiB:.0f} MiB, {short.short_bytes / MiB:.0f} MiB short. Free that much on "
        f"{name} (or raise its --mem-budget), add a device, or lower --ctx"
    )
