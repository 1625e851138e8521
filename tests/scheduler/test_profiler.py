"""Profiler sanity: every probe returns a positive number and the profile is self-consistent."""

from __future__ import annotations

import json

import pytest

from prima.scheduler import profiler
from prima.scheduler.profile import OS_CLASSES, DeviceProfile

SMALL = profiler.ProbeSizes(mem_bytes=1 << 20, disk_bytes=1 << 20, gemv_rows=64, gemv_cols=64, repeats=2)


def test_profiler_probes_are_positive(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"\x01" * (256 << 10))
    assert profiler.measure_disk_read(f, 1 << 20) > 0
    assert profiler.measure_disk_read(None, 1 << 20, scratch_dir=tmp_path / "scratch") > 0
    assert list((tmp_path / "scratch").iterdir()) == []  # the scratch file is removed
    assert profiler.measure_mem_bandwidth(1 << 20, repeats=2) > 0
    assert profiler.numpy_gemv_flops(32, 32, repeats=2) > 0
    assert profiler.os_class() in OS_CLASSES


def test_profiler_profile_is_consistent_and_round_trips(tmp_path):
    calls: list[str] = []

    def bench(fmt: str) -> float:
        calls.append(fmt)
        return 1e9

    dev = profiler.profile_device(
        "me", "127.0.0.1:7070", kernel_bench=bench, sizes=SMALL, net_latency_ms=2.0, scratch_dir=tmp_path
    )
    assert dev.node_id == "me"
    assert 0 < dev.ram_available_bytes <= dev.ram_total_bytes
    assert 0 <= dev.swap_free_bytes <= dev.swap_total_bytes
    assert dev.disk_read_bytes_per_s > 0
    assert dev.mem_bandwidth_bytes_per_s > 0
    assert dev.cpu_flops == {"F32": 1e9}
    assert calls == ["F32"]
    assert dev.net_latency_ms == 2.0
    assert DeviceProfile.from_dict(json.loads(json.dumps(dev.to_dict()))) == dev


def test_profiler_measures_the_model_formats(tmp_path, write_tiny_gguf):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    dev = profiler.profile_device("me", model_path=path, kernel_bench=lambda fmt: 3e9, sizes=SMALL)
    # The tiny model has F32 and F16 layers and an F16 output head.
    assert dev.cpu_flops == {"F32": 3e9, "F16": 3e9}
    assert dev.disk_read_bytes_per_s > 0


def test_profiler_default_gemv_stands_in_for_every_format(tmp_path, write_tiny_gguf):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    dev = profiler.profile_device("me", model_path=path, sizes=SMALL)
    assert set(dev.cpu_flops) == {"F32", "F16"}
    assert len(set(dev.cpu_flops.values())) == 1
    assert dev.cpu_flops["F32"] > 0


@pytest.mark.parametrize("fmt", ["Q4_K", "F16"])
def test_profiler_measure_formats_always_includes_f32(fmt):
    assert set(profiler.measure_formats([fmt], lambda f: 2e9)) == {"F32", fmt}
