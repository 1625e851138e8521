"""Halda plans an acl node at the memory its layers take on the NPU
(prima.scheduler.cost_model.accel_layer_bytes): each layer's weights in fp16, room for the
compiled gears, and its KV cache in fp16; and on a 310B-like SoC, whose NPU shares the RAM,
those copies come out of the RAM the CPU's layers use. The devices are synthetic profiles: no
NPU figure."""

from __future__ import annotations

from prima.scheduler.cost_model import NPU_GEAR_OVERHEAD, device_cost, device_time
from prima.scheduler.halda import solve
from prima.scheduler.profile_schema import AcceleratorProfile, DeviceProfile
from tests.scheduler.conftest import GiB, make_device, make_model

N_LAYERS = 12


def _board(ram_gib: float, shares_ram: bool = True, npu_gib: float | None = None) -> DeviceProfile:
    """An OrangePi AIpro-like node: a slow CPU beside an acl NPU ten times faster that shares
    its RAM (get_mem_info then answers with the host's memory), or has `npu_gib` of its own."""
    accel = AcceleratorProfile(
        kind="acl",
        memory_available_bytes=int((ram_gib if npu_gib is None else npu_gib) * GiB),
        flops={"F32": 100e9},
        mem_bandwidth_bytes_per_s=20e9,
        shares_ram=shares_ram,
    )
    return make_device("opi", ram_gib=ram_gib, gflops=10.0, accel=accel)


def test_an_npu_layer_costs_its_fp16_weights_gears_and_kv() -> None:
    model = make_model(N_LAYERS, layer_mib=200, kv_mib=4)  # Q4_K-like: 4.5 bits a weight
    cost = device_cost(_board(8.0), model, is_head=False)
    weights = sum(model.layer_flops.values()) / 2
    assert (
        cost.accel_layer_bytes == int(2 * weights * (1 + NPU_GEAR_OVERHEAD)) + model.kv_bytes_per_layer // 2
    )
    assert cost.accel_layer_bytes > 3.5 * cost.layer_ram_bytes  # fp16 is 3.5x Q4 before the gears


def test_a_shared_memory_soc_pays_for_its_npu_layers_in_ram() -> None:
    """6 GiB free holds the 12 layers as the CPU maps them (12 x 204 MiB), not as the NPU
    holds them (12 x ~1.4 GiB): all on the NPU does not fit, a few do, the rest on the CPU."""
    model = make_model(N_LAYERS, layer_mib=200, kv_mib=4)
    board = _board(6.0)
    cost = device_cost(board, model, is_head=False)
    assert device_time(cost, 1, N_LAYERS, 0) is not None
    assert device_time(cost, 1, N_LAYERS, N_LAYERS) is None
    assert device_time(cost, 1, N_LAYERS, 2) is not None
    plan = solve([board], model)
    on_npu = plan.nodes[0].accel_layers
    assert 0 < on_npu < N_LAYERS
    host = N_LAYERS - on_npu
    used = on_npu * cost.accel_layer_bytes + host * cost.layer_ram_bytes + model.head_resident_bytes
    assert used <= board.ram_available_bytes
    # With memory of its own for the NPU, the RAM no longer limits it: every layer goes there.
    own = _board(6.0, shares_ram=False, npu_gib=32.0)
    assert solve([own], model).nodes[0].accel_layers == N_LAYERS
