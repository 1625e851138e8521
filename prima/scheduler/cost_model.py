"""The cost model: predicted time per token of a ring for a given layer assignment.

For a ring of M devices (head first), k rounds, t_m layers a token on device m (in k windows of
t_m // k or one more layers, prima.plan.split_layers) and n_m accelerator layers per window:

    T = max( kappa + sum_m (a_m * t_m + b_m * N_m + c_m * H_m),          the trip round the ring
             max_m d_m * Y_m + a_m * t_m + b_m * N_m + c_m * H_m )         each device's own time

with H_m = min(k, t_m) its windows that are not empty (a hop after each) and N_m its
accelerator layers in all of them. With windows of w_m layers in every round (t_m = k w_m) the
terms are k * (a_m * w_m + b_m * n_m + c_m), the original's form (`device_time`).

- a_m  CPU ms per layer: GEMV FLOPs / measured FLOP/s per weight format, plus reading the
       layer's KV cache (full planned context) at memory bandwidth.
- b_m  ms saved (negative) or added per layer moved to the accelerator.
- d_m  ms to read one layer's weights from disk. A device short of memory for its U_m layers
       in RAM (its layers less its accelerator's, or all of them when the accelerator reads the
       RAM in place) pins as many as its budget holds after its KV cache and a stream buffer of
       u_m + 1 layers (u_m: its largest window's layers in RAM), and rereads the rest every token.
- c_m  ms to send one activation to the next ring member: latency + bytes / bandwidth. A lone
       device sends nothing, so c is 0 when M == 1. (The original system sets c_m = 0.)
- kappa  the output head on the head node: as the head timed it, else from its FLOPs.

Y_m = U_m - P_m are the layers device m rereads per token. Its disk reads them while the rest
of the ring computes (the prefetch thread runs ahead of compute), so they bound T next to the
trip instead of adding to it. Devices that read one disk (daemons on one machine: equal
`shared_disk`) share its bandwidth, so their rereads add up: T >= sum over them of d_m * Y_m.

Disk, per device: a device that holds only some layers of the model (it fetched them from a
peer) fetches the others its windows need, and may hold at most `disk_budget_bytes` after that;
an assignment over that budget does not fit. Windows lie in the plan's order (the members after
the head, then the head, in every round), so which layers a device gets depends on the windows
before it (prima.plan.layer_windows).

Memory, per device (bytes): a resident device needs U_m*(layer + KV) + fixed_m <= RAM budget;
a streaming device pins P_m layers: P_m*layer + (u_m + 1)*layer + U_m*KV + fixed_m <= budget.
Accelerator layers need N_m*e_m <= accelerator memory, e_m one layer's footprint there: the layer and its KV as the CPU
holds them, or, for an NPU that holds its own copy (acl), its weights in fp16 with room for its
compiled gears and its KV in fp16 (`accel_layer_bytes`). On a SoC whose NPU shares the RAM
(the 310B), that copy comes out of the RAM budget too: N_m*e_m is added to its left side, and
its accelerator layers are not in U_m. Both Halda and the brute-force check in the tests
evaluate plans through `ring_time_of_counts`, so they cannot disagree about what a plan costs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prima.plan import layer_windows
from prima.scheduler.profile_schema import KV_ELEMENT_BYTES, AcceleratorProfile, DeviceProfile, ModelProfile

FALLBACK_FORMAT = "F32"
# The compiled gears of an NPU window take memory beside its fp16 weights: ATC builds a graph per
# gear, and qwen-ascend-llm's notes report 50-100% more for dynamic shapes on the 310B. The upper
# end, unmeasured here (nothing in prima has run on an NPU).
NPU_GEAR_OVERHEAD = 1.0
NPU_KV_ELEMENT_BYTES = 2  # the acl backend's KV cache is float16


@dataclass(frozen=True)
class DeviceCost:
    """Per-device coefficients of the objective (ms) and of the memory constraints (bytes)."""

    cpu_ms_per_layer: float  # a_m
    accel_delta_ms_per_layer: float  # b_m (0 without an accelerator)
    disk_ms_per_layer: float  # d_m (inf when the device cannot stream from disk)
    hop_ms: float  # c_m
    fixed_ms: float  # this device's share of kappa (only the head's is non-zero)
    layer_weight_bytes: int
    layer_kv_bytes: int
    fixed_bytes: int  # embedding + output head (+ a draft model) on the head, 0 elsewhere
    ram_budget_bytes: int
    accel_budget_bytes: int  # 0 without an accelerator
    accel_shares_ram: bool
    held_layers: frozenset[int] | None = None  # None: the whole model file
    fetch_room_layers: int = -1  # layers it may fetch within its disk budget; -1: no budget
    shared_disk: str = ""  # devices with the same non-empty name read one disk
    accel_layer_bytes: int = 0  # e_m: one layer on the accelerator (0: layer_ram_bytes)
    accel_copies_weights: bool = False  # the accelerator holds its own copy of its layers (an NPU)

    @property
    def layer_ram_bytes(self) -> int:
        """b' in the reference: one resident layer with its KV cache."""
        return self.layer_weight_bytes + self.layer_kv_bytes

    @property
    def accel_bytes_per_layer(self) -> int:
        """e_m: what one layer takes in the accelerator's memory."""
        return self.accel_layer_bytes or self.layer_ram_bytes

    def accel_ram_bytes(self, accel_layers: int) -> int:
        """RAM the accelerator's own copies of its layers (all windows together) take: all of
        them on a SoC where it shares the RAM, none where it has its own memory or reads the
        CPU's pages in place."""
        if self.accel_shares_ram and self.accel_copies_weights:
            return accel_layers * self.accel_bytes_per_layer
        return 0

    @property
    def has_accel(self) -> bool:
        return self.accel_budget_bytes > 0

    @property
    def can_stream(self) -> bool:
        return math.isfinite(self.disk_ms_per_layer)


def gemv_ms(flops: Mapping[str, float], throughput: Mapping[str, float]) -> float:
    """Time (ms) for work given per weight format, at per-format throughput (FLOP/s).
    A format the device was not measured on runs at its F32 speed."""
    total = 0.0
    for fmt, n in flops.items():
        speed = throughput.get(fmt, throughput.get(FALLBACK_FORMAT, 0.0))
        if n and speed <= 0:
            return math.inf
        total += n / speed * 1e3 if n else 0.0
    return total


def device_cost(device: DeviceProfile, model: ModelProfile, *, is_head: bool) -> DeviceCost:
    """The coefficients for `device` in a ring of two or more (see `ring_costs` for M == 1)."""
    kv_read_bytes = model.kv_bytes_per_layer  # attention reads the whole cached context
    cpu = gemv_ms(model.layer_flops, device.cpu_flops) + _transfer_ms(
        kv_read_bytes, device.mem_bandwidth_bytes_per_s
    )
    accel = device.accelerator
    delta = 0.0
    accel_budget = 0
    shares = copies = False
    accel_bytes = 0
    if accel is not None and accel.memory_available_bytes > 0:
        on_accel = gemv_ms(model.layer_flops, accel.flops) + _transfer_ms(
            kv_read_bytes, accel.mem_bandwidth_bytes_per_s
        )
        if math.isfinite(on_accel):
            delta = on_accel - cpu
            accel_budget = accel.memory_available_bytes
            shares = accel.shares_ram
            copies = accel.kind == "acl"
            accel_bytes = accel_layer_bytes(accel, model)
    disk = _transfer_ms(model.layer_bytes, device.disk_read_bytes_per_s)
    hop = device.net_latency_ms + _transfer_ms(model.activation_bytes, device.net_bandwidth_bytes_per_s)
    fixed_ms = 0.0
    if is_head:
        fixed_ms = device.output_ms if device.output_ms > 0 else gemv_ms(model.output_flops, device.cpu_flops)
    return DeviceCost(
        held_layers=None if device.held_layers is None else frozenset(device.held_layers),
        fetch_room_layers=fetch_room_layers(device, model, is_head=is_head),
        shared_disk=device.shared_disk,
        cpu_ms_per_layer=cpu,
        accel_delta_ms_per_layer=delta,
        disk_ms_per_layer=disk,
        hop_ms=hop,
        fixed_ms=fixed_ms,
        layer_weight_bytes=model.layer_bytes,
        layer_kv_bytes=model.kv_bytes_per_layer,
        fixed_bytes=model.head_resident_bytes if is_head else 0,
        ram_budget_bytes=device.ram_available_bytes,
        accel_budget_bytes=accel_budget,
        accel_shares_ram=shares,
        accel_layer_bytes=accel_bytes,
        accel_copies_weights=copies,
    )


def accel_layer_bytes(accel: AcceleratorProfile, model: ModelProfile) -> int:
    """One layer's footprint in `accel`'s memory. The acl backend holds its own copy: the
    weights dequantized to fp16 (2 bytes a weight, and a layer's FLOPs per token are 2 a
    weight), NPU_GEAR_OVERHEAD more for its compiled gears, and the KV cache in fp16 (1.9x a
    Q8_0 layer's GGUF bytes, 3.5x a Q4_0's, before the gears). Anything else reads the layer as
    the CPU holds it."""
    if accel.kind != "acl":
        return model.layer_bytes + model.kv_bytes_per_layer
    return npu_layer_bytes(model)


def npu_layer_bytes(model: ModelProfile) -> int:
    """One layer on the acl backend's NPU: fp16 weights, NPU_GEAR_OVERHEAD more for the gears,
    and `model.ctx_tokens` of fp16 KV cache. What Halda plans with, and what a daemon on a
    shared-memory SoC takes out of its RAM budget for each layer it puts there."""
    fp16_weights = sum(model.layer_flops.values())
    kv = model.kv_bytes_per_layer * NPU_KV_ELEMENT_BYTES // KV_ELEMENT_BYTES
    return int(fp16_weights * (1 + NPU_GEAR_OVERHEAD)) + kv


def fetch_room_layers(device: DeviceProfile, model: ModelProfile, *, is_head: bool) -> int:
    """How many layers `device` may fetch within its disk budget (-1: no budget, or it holds the
    whole file and fetches nothing): the budget less what it holds, less the embedding and output
    head when it heads the ring without them. The few small non-layer tensors are not counted."""
    if device.disk_budget_bytes <= 0 or device.held_layers is None:
        return -1
    room = device.disk_budget_bytes - device.held_bytes
    if is_head and not device.holds_head_tensors:
        room -= model.input_bytes + model.output_bytes
    if model.layer_bytes <= 0:
        return -1
    return max(room, 0) // model.layer_bytes


def ring_costs(devices: Sequence[DeviceProfile], model: ModelProfile) -> list[DeviceCost]:
    """Coefficients for every device of a candidate ring, `devices[0]` being the head."""
    return [device_cost(d, model, is_head=i == 0) for i, d in enumerate(devices)]


def ram_layers(cost: DeviceCost, window: int, accel_layers: int) -> int:
    """u: layers per window the CPU holds in RAM (accelerator layers it does not, unless the
    accelerator reads them in place from the RAM it shares)."""
    in_place = cost.accel_shares_ram and not cost.accel_copies_weights
    return window if in_place else window - accel_layers


def streams(cost: DeviceCost, rounds: int, window: int, accel_layers: int) -> bool:
    """Whether the device is short of memory for its k*u layers and must stream some from disk."""
    u = ram_layers(cost, window, accel_layers)
    return (
        _resident_bytes(cost, rounds * u, cost.accel_ram_bytes(rounds * accel_layers)) > cost.ram_budget_bytes
    )


def _resident_bytes(cost: DeviceCost, ram_layers_total: int, accel_ram_bytes: int) -> int:
    """RAM a device needs to keep all its layers resident: each with its KV cache, its fixed
    tensors and the accelerator's copies in RAM."""
    return ram_layers_total * cost.layer_ram_bytes + cost.fixed_bytes + accel_ram_bytes


def stream_buffer_layers(ram_layers_per_window: int) -> int:
    """Layers of room a streaming device keeps for layers in flight: the next window, read while
    the last layer of this one computes (weights.window.stream_buffer_bytes does the same)."""
    return ram_layers_per_window + 1


def pinned_layers(cost: DeviceCost, rounds: int, ram_layers_per_window: int, accel_ram_bytes: int = 0) -> int:
    """How many of its k*u layers a streaming device keeps resident (the rest it rereads every
    token): what its budget holds after all its KV cache, the stream buffer and the accelerator's
    copies in RAM; -1 if it cannot stream at all (no disk, or no room for the buffer)."""
    u = ram_layers_per_window
    return _pinned(cost, rounds * u, u, accel_ram_bytes)


def _pinned(cost: DeviceCost, ram_layers_total: int, largest_ram_window: int, accel_ram_bytes: int) -> int:
    """`pinned_layers` for any windows: of `ram_layers_total` layers in RAM whose largest window
    holds `largest_ram_window`, how many a streaming device keeps; -1 if it cannot stream."""
    room = cost.ram_budget_bytes - _stream_overhead_bytes(
        cost, ram_layers_total, largest_ram_window, accel_ram_bytes
    )
    if not cost.can_stream or room < 0:
        return -1
    if cost.layer_weight_bytes <= 0:
        return ram_layers_total
    return min(ram_layers_total, room // cost.layer_weight_bytes)


def _stream_overhead_bytes(
    cost: DeviceCost, ram_layers_total: int, largest_ram_window: int, accel_ram_bytes: int
) -> int:
    """What a streaming device's RAM holds besides its pinned layers: its fixed tensors, the
    accelerator's copies, all its KV cache and the stream buffer."""
    return (
        cost.fixed_bytes
        + accel_ram_bytes
        + ram_layers_total * cost.layer_kv_bytes
        + stream_buffer_layers(largest_ram_window) * cost.layer_weight_bytes
    )


@dataclass(frozen=True)
class DeviceTime:
    """One device's terms of T, in ms per token."""

    path_ms: float  # its part of the trip round the ring: k (a w + b n + c)
    disk_ms: float  # rereading the layers it cannot keep: d (k u - pinned)

    @property
    def own_ms(self) -> float:
        """What the device itself spends per token: its reads, then its compute. Its disk works
        while the rest of the ring computes, so this bounds T apart from the trip."""
        return self.disk_ms + self.path_ms


@dataclass(frozen=True)
class MemberShape:
    """What a device's windows come to when it computes `layers` layers a token over k rounds
    (prima.plan.split_layers: windows of q = layers // k or q + 1 layers, the first n of each
    on the accelerator as prima.forward.placement splits them)."""

    windows: int  # non-empty windows: the hops it sends a token
    accel_layers: int  # on the accelerator, all windows together
    ram_layers: int  # in the CPU's RAM, all windows together
    largest_ram_window: int  # the stream buffer holds one such window ahead (+ a layer)

    @classmethod
    def of(cls, cost: DeviceCost, rounds: int, layers: int, accel_per_window: int) -> MemberShape:
        q, extra = divmod(layers, rounds)
        n = accel_per_window
        # (size, how many windows of it) for the q-layer and the (q+1)-layer windows.
        kinds = [(q, rounds - extra), (q + 1, extra)]
        accel = sum(min(n, size) * count for size, count in kinds)
        in_place = cost.accel_shares_ram and not cost.accel_copies_weights
        largest = max(size - (0 if in_place else min(n, size)) for size, count in kinds if count)
        return cls(min(rounds, layers), accel, layers if in_place else layers - accel, largest)


@dataclass(frozen=True)
class MemberMemory:
    """How a device's layers sit in its memory: all resident, or `pinned` of its RAM layers kept
    and the rest reread from disk every token."""

    shape: MemberShape
    streams: bool
    pinned: int  # RAM layers kept resident (all of them when it does not stream)
    needed_bytes: int  # RAM it plans to use: layers kept, stream buffer, KV cache, fixed

    @property
    def reread_layers(self) -> int:
        return self.shape.ram_layers - self.pinned


def member_memory(cost: DeviceCost, rounds: int, layers: int, accel_per_window: int) -> MemberMemory | None:
    """Where the `layers` layers a token of a device (over k = `rounds` rounds, see MemberShape)
    live, or None when they do not fit its memory or accelerator memory."""
    k, n = rounds, accel_per_window
    shape = MemberShape.of(cost, k, layers, n)
    if n and (
        not cost.has_accel
        or n > -(-layers // k)  # more than its largest window: the same as that many
        or shape.accel_layers * cost.accel_bytes_per_layer > cost.accel_budget_bytes
    ):
        return None
    accel_ram = cost.accel_ram_bytes(shape.accel_layers)
    resident = _resident_bytes(cost, shape.ram_layers, accel_ram)
    if resident <= cost.ram_budget_bytes:
        return MemberMemory(shape, False, shape.ram_layers, resident)
    # Short of memory: pin what fits after the KV cache and a stream buffer, reread the rest.
    pinned = _pinned(cost, shape.ram_layers, shape.largest_ram_window, accel_ram)
    if pinned < 0:
        return None
    around = _stream_overhead_bytes(cost, shape.ram_layers, shape.largest_ram_window, accel_ram)
    return MemberMemory(shape, True, pinned, around + pinned * cost.layer_weight_bytes)


def member_time(
    cost: DeviceCost, rounds: int, layers: int, accel_per_window: int, *, sends: bool = True
) -> DeviceTime | None:
    """The terms of T of a device computing `layers` layers a token over k = `rounds` rounds
    (any count, not only a multiple of k: see MemberShape), with `accel_per_window` layers of
    each window on its accelerator; None when they do not fit. `sends` is false for a lone
    device, which has no next hop."""
    if layers <= 0:
        return DeviceTime(0.0, 0.0)
    memory = member_memory(cost, rounds, layers, accel_per_window)
    if memory is None:
        return None
    shape = memory.shape
    disk = cost.disk_ms_per_layer * memory.reread_layers if memory.streams else 0.0
    hop = cost.hop_ms if sends else 0.0
    path = (
        cost.cpu_ms_per_layer * layers
        + cost.accel_delta_ms_per_layer * shape.accel_layers
        + hop * shape.windows
    )
    return DeviceTime(path, disk)


def device_time(
    cost: DeviceCost, rounds: int, window: int, accel_layers: int, *, sends: bool = True
) -> DeviceTime | None:
    """The device's terms of T with a window of `window` layers in each of k rounds, or None
    when its layers do not fit (`member_time` of k * window layers)."""
    if accel_layers > window:
        return None
    return member_time(cost, rounds, rounds * window, accel_layers, sends=sends)


def device_time_ms(
    cost: DeviceCost, rounds: int, window: int, accel_layers: int, *, sends: bool = True
) -> float:
    """The device's own time per token (its reads + its part of the trip), inf if it does not fit."""
    t = device_time(cost, rounds, window, accel_layers, sends=sends)
    return math.inf if t is None else t.own_ms


def ring_fetched_layers(
    costs: Sequence[DeviceCost], rounds: int, window_sizes: Sequence[int]
) -> tuple[int, ...] | None:
    """Layers each member must fetch for these windows; None when one would exceed its disk
    budget."""
    return ring_fetched_of_counts(costs, rounds, [rounds * w for w in window_sizes])


def ring_fetched_of_counts(
    costs: Sequence[DeviceCost], rounds: int, layer_counts: Sequence[int]
) -> tuple[int, ...] | None:
    """Layers each member must fetch when member m computes layer_counts[m] layers a token (laid
    out as prima.plan.layer_windows does); None when one would exceed its disk budget."""
    if all(c.held_layers is None for c in costs):
        return (0,) * len(costs)
    windows = layer_windows(layer_counts, rounds)
    counts = tuple(
        0
        if c.held_layers is None
        else sum(1 for w in ws for layer in range(w.start, w.end) if layer not in c.held_layers)
        for c, ws in zip(costs, windows, strict=True)
    )
    if any(0 <= c.fetch_room_layers < n for c, n in zip(costs, counts, strict=True)):
        return None
    return counts


def ring_time_ms(
    costs: Sequence[DeviceCost], rounds: int, window_sizes: Sequence[int], accel_layers: Sequence[int]
) -> float:
    """Predicted ms per token of a ring (costs[0] the head) with a window of window_sizes[m]
    layers on member m in each of k = `rounds` rounds (`ring_time_of_counts`)."""
    return ring_time_of_counts(costs, rounds, [rounds * w for w in window_sizes], accel_layers)


def ring_time_of_counts(
    costs: Sequence[DeviceCost], rounds: int, layer_counts: Sequence[int], accel_layers: Sequence[int]
) -> float:
    """Predicted ms per token of a ring (costs[0] the head) whose member m computes
    layer_counts[m] layers a token over k = `rounds` rounds, accel_layers[m] of each window on
    its accelerator; inf if any device's layers do not fit its memory or its disk budget.
    T = max(kappa + the trip round the ring, each device's own reads + compute, each shared
    disk's reads for all its devices): the trip is serial, while each device's disk streams
    its next layers as the others compute."""
    if ring_fetched_of_counts(costs, rounds, layer_counts) is None:
        return math.inf
    sends = len(costs) > 1
    trip = costs[0].fixed_ms
    own = 0.0
    shared: dict[str, float] = {}
    for cost, t, n in zip(costs, layer_counts, accel_layers, strict=True):
        time = member_time(cost, rounds, t, n, sends=sends)
        if time is None:
            return math.inf
        trip += time.path_ms
        own = max(own, time.own_ms)
        if cost.shared_disk:
            shared[cost.shared_disk] = shared.get(cost.shared_disk, 0.0) + time.disk_ms
    return max(trip, own, *shared.values())


def predict_ms_per_token(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    rounds: int,
    window_sizes: Sequence[int],
    accel_layers: Sequence[int] | None = None,
) -> float:
    """Predicted ms per token of `devices` (ring order, head first) running `model` with the
    given windows; inf when the assignment does not fit in memory."""
    if rounds * sum(window_sizes) != model.n_layers:
        raise ValueError(
            f"{rounds} rounds x windows {list(window_sizes)} do not cover {model.n_layers} layers"
        )
    accel = accel_layers if accel_layers is not None else [0] * len(devices)
    return ring_time_ms(ring_costs(devices, model), rounds, window_sizes, accel)


def _transfer_ms(n_bytes: float, bytes_per_s: float) -> float:
    if n_bytes <= 0:
        return 0.0
    if bytes_per_s <= 0:
        return math.inf
    return n_bytes / bytes_per_s * 1e3
