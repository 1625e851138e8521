"""How many layers per window one device can hold in k rounds: the cost model's memory rules
(prima.scheduler.cost_model) as exact integers. Halda uses it to order its search and to say why
a device was dropped; halda_fit to say what memory a plan lacks."""

from __future__ import annotations

from dataclasses import dataclass

from prima.scheduler.cost_model import DeviceCost


@dataclass(frozen=True)
class Capacity:
    """How many layers per window device m can take in k rounds (all counts per window)."""

    resident: int  # R: layers in RAM that fit resident, k u b' + fixed <= budget
    streaming: int  # S: layers in RAM that fit when streaming, or -1 if streaming cannot help
    accel: int  # nmax: layers the accelerator memory holds, k n e <= accelerator memory

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
    accel = _fit(cost.accel_budget_bytes, k * cost.accel_bytes_per_layer, per_round) if cost.has_accel else 0
    return Capacity(resident, streaming, accel)


def _fit(room: int, per_layer: int, cap: int) -> int:
    if room < 0:
        return -1
    return cap if per_layer <= 0 else min(cap, room // per_layer)
