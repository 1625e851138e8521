"""The cost model's coefficients and its memory cases, checked by hand-computed numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from prima.scheduler.cost_model import (
    device_cost,
    device_time_ms,
    gemv_ms,
    pinned_layers,
    predict_ms_per_token,
    ring_costs,
)
from prima.scheduler.profile_schema import AcceleratorProfile

MiB = 1 << 20
GiB = 1 << 30


def test_cost_model_coefficients_follow_the_formulas(make_device, make_model):
    model = make_model(n_layers=8, layer_mib=100, kv_mib=8)
    dev = make_device("d", gflops=10.0, mem_gbps=8.0, disk_gbps=2.0, latency_ms=5.0, net_mbps=80.0)
    c = device_cost(dev, model, is_head=False)
    flops = model.layer_flops["Q4_K"]
    assert c.cpu_ms_per_layer == pytest.approx(flops / 10e9 * 1e3 + 8 * MiB / 8e9 * 1e3)
    assert c.disk_ms_per_layer == pytest.approx(100 * MiB / 2e9 * 1e3)
    # 5 ms latency + 16 KiB of f32 activations over 10 MB/s.
    assert c.hop_ms == pytest.approx(5.0 + 4096 * 4 / 10e6 * 1e3)
    assert c.fixed_ms == 0.0
    assert c.fixed_bytes == 0
    head = device_cost(dev, model, is_head=True)
    # The untied embedding is read a row per token; the output head in full.
    assert head.fixed_bytes == model.head_resident_bytes == model.output_bytes
    tied = dataclasses.replace(model, tied_output=True)
    assert device_cost(dev, tied, is_head=True).fixed_bytes == model.input_bytes + model.output_bytes
    assert head.fixed_ms == pytest.approx(model.output_flops["Q6_K"] / 10e9 * 1e3)


def test_cost_model_unmeasured_format_runs_at_f32_speed():
    assert gemv_ms({"Q4_K": 2e9}, {"F32": 1e9}) == pytest.approx(2000.0)
    assert gemv_ms({"Q4_K": 2e9}, {"Q4_K": 4e9, "F32": 1e9}) == pytest.approx(500.0)
    assert gemv_ms({"Q4_K": 2e9}, {}) == math.inf


def test_cost_model_ring_time_sums_rounds_hops_and_kappa(make_device, make_model):
    model = make_model(n_layers=8)
    devices = [make_device("a"), make_device("b", gflops=5.0)]
    a, b = ring_costs(devices, model)
    t = predict_ms_per_token(devices, model, 2, [3, 1])
    expected = a.fixed_ms + 2 * (3 * a.cpu_ms_per_layer + a.hop_ms) + 2 * (1 * b.cpu_ms_per_layer + b.hop_ms)
    assert t == pytest.approx(expected)


def test_cost_model_lone_device_sends_nothing(make_device, make_model):
    model = make_model(n_layers=8)
    dev = make_device("a", latency_ms=50.0)
    (c,) = ring_costs([dev], model)
    assert predict_ms_per_token([dev], model, 1, [8]) == pytest.approx(c.fixed_ms + 8 * c.cpu_ms_per_layer)


def test_cost_model_streams_only_when_short_of_memory(make_device, make_model):
    model = make_model(n_layers=12, layer_mib=100, kv_mib=0)
    c = device_cost(make_device("d", ram_gib=0.5, disk_gbps=1.0), model, is_head=False)
    # 5 layers = 500 MiB fit in 512 MiB: no disk term.
    assert device_time_ms(c, 1, 5, 0) == pytest.approx(5 * c.cpu_ms_per_layer + c.hop_ms)
    # 6 layers in 3 rounds of 2: short of memory. A buffer of 3 layers (300 MiB) leaves room to
    # pin 2 of the 6 (200 MiB): 4 layers are reread every token, while the rest of the ring runs.
    assert pinned_layers(c, 3, 2) == 2
    assert device_time_ms(c, 3, 2, 0) == pytest.approx(
        4 * c.disk_ms_per_layer + 3 * (2 * c.cpu_ms_per_layer + c.hop_ms)
    )
    # One round of 6: streaming would need a 7-layer buffer.
    assert device_time_ms(c, 1, 6, 0) == math.inf
    no_disk = device_cost(make_device("d", ram_gib=0.5, disk_gbps=0.0), model, is_head=False)
    assert device_time_ms(no_disk, 3, 2, 0) == math.inf


def test_cost_model_accelerator_layers(make_device, make_model):
    model = make_model(n_layers=8, layer_mib=100, kv_mib=0)
    gpu = AcceleratorProfile(
        "cuda", memory_available_bytes=300 * MiB, flops={"F32": 200e9}, mem_bandwidth_bytes_per_s=300e9
    )
    c = device_cost(
        make_device("d", ram_gib=0.25, gflops=10.0, disk_gbps=0.0, accel=gpu), model, is_head=False
    )
    assert c.accel_delta_ms_per_layer < 0
    # 3 layers on the GPU and 2 in RAM: fits both.
    assert device_time_ms(c, 1, 5, 3) == pytest.approx(
        5 * c.cpu_ms_per_layer + 3 * c.accel_delta_ms_per_layer + c.hop_ms
    )
    assert device_time_ms(c, 1, 5, 4) == math.inf  # 400 MiB on a 300 MiB GPU
    assert device_time_ms(c, 1, 6, 3) == math.inf  # 300 MiB left in 256 MiB of RAM
    unified = AcceleratorProfile("metal", 300 * MiB, {"F32": 200e9}, 300e9, shares_ram=True)
    shared = device_cost(make_device("m", ram_gib=0.25, disk_gbps=0.0, accel=unified), model, is_head=False)
    assert device_time_ms(shared, 1, 3, 3) == math.inf  # unified memory: GPU layers count in RAM too
    assert math.isfinite(device_time_ms(shared, 1, 2, 2))


def test_cost_model_rejects_windows_that_miss_layers(make_device, make_model):
    with pytest.raises(ValueError, match="do not cover"):
        predict_ms_per_token([make_device("a")], make_model(n_layers=8), 1, [7])


def test_cost_model_disk_overlaps_the_rest_of_the_ring(make_device, make_model):
    """A streaming device's reads bound T beside the trip round the ring, not on top of it."""
    model = make_model(n_layers=12, layer_mib=100, kv_mib=0)
    devices = [make_device("head", ram_gib=4.0), make_device("small", ram_gib=0.5, disk_gbps=0.2)]
    head, small = ring_costs(devices, model)
    t = predict_ms_per_token(devices, model, 3, [2, 2])
    trip = head.fixed_ms + 3 * (
        2 * head.cpu_ms_per_layer + head.hop_ms + 2 * small.cpu_ms_per_layer + small.hop_ms
    )
    reread = 6 - pinned_layers(small, 3, 2)
    own = reread * small.disk_ms_per_layer + 3 * (2 * small.cpu_ms_per_layer + small.hop_ms)
    assert reread > 0
    assert t == pytest.approx(max(trip, own))
    assert t < trip + reread * small.disk_ms_per_layer


def test_cost_model_devices_on_one_disk_share_its_bandwidth(make_device, make_model):
    """Two streaming daemons on one machine read one disk: their rereads add up and bound T,
    which neither does alone; on disks of their own each bounds T by itself."""
    model = make_model(n_layers=12, layer_mib=100, kv_mib=0)
    own = [make_device("a", ram_gib=0.5, disk_gbps=0.2), make_device("b", ram_gib=0.5, disk_gbps=0.2)]
    one_disk = [dataclasses.replace(d, shared_disk="boot/8:0") for d in own]
    costs = ring_costs(one_disk, model)
    reads = [c.disk_ms_per_layer * (6 - pinned_layers(c, 3, 2)) for c in costs]
    assert all(r > 0 for r in reads)
    apart = predict_ms_per_token(own, model, 3, [2, 2])
    together = predict_ms_per_token(one_disk, model, 3, [2, 2])
    assert together == pytest.approx(sum(reads))
    assert apart < together


def test_shared_disk_survives_the_profile_json(make_device):
    from prima.scheduler.profile_schema import DeviceProfile

    d = dataclasses.replace(make_device("a"), shared_disk="boot/259:0")
    assert DeviceProfile.from_dict(d.to_dict()) == d
