"""The profiler's probes and the profile they make.

Time is injected (tests/fake_time.py), so each probe's rate is checked exactly against the work it
did: bytes copied, bytes read from the file, FLOPs of the product, over the best timed interval.
Nothing here asserts how fast this machine is."""

from __future__ import annotations

import itertools
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from prima.model.gguf_file import GGUFFile
from prima.net import codec
from prima.scheduler import device_probe
from prima.scheduler.profile_cache import load_or_measure
from prima.scheduler.profile_schema import OS_CLASSES, DeviceProfile, ModelProfile
from prima.weights.window import READAHEAD_CHUNK, Span, mapped_resident_bytes
from tests.fake_time import FakeTime

MiB = 1 << 20
SMALL = device_probe.ProbeSizes(mem_bytes=MiB, disk_bytes=MiB, gemv_rows=64, gemv_cols=64, repeats=2)
# Readings alternate start, end: timed intervals of 3, 1 and 2 ms (the best is 1 ms).
THREE_TIMINGS_S = [0.0, 3e-3, 0.0, 1e-3, 0.0, 2e-3]
_FADVISE = os.posix_fadvise


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime(1.0)
    monkeypatch.setattr(device_probe, "time", fake)
    return fake


@pytest.fixture
def fadvised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(offset, length, advice) of each posix_fadvise call the disk probe makes (and makes)."""
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, off: int, n: int, advice: int) -> None:
        calls.append((off, n, advice))
        real(fd, off, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


def write_on_disk(path: Path, data: bytes) -> None:
    """`data` written, synced and out of the page cache, as a model file on disk is: pages just
    written can stay cached through POSIX_FADV_DONTNEED for a moment (dirty, or queued on
    another CPU), and the probe skips cached pieces. Bounded: 50 tries over ~2.5 s."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    view = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    pages = np.frombuffer(view, dtype=np.uint8)
    try:
        for _ in range(50):
            _FADVISE(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # not the one the test records
            if mapped_resident_bytes(pages.ctypes.data, Span(0, len(data))) <= mmap.PAGESIZE:
                return
            time.sleep(0.05)
    finally:
        del pages
        view.close()
        os.close(fd)
    pytest.fail(f"{path} stayed in the page cache")


def test_mem_bandwidth_is_the_bytes_moved_over_the_best_copy(clock: FakeTime) -> None:
    clock.steps_s = THREE_TIMINGS_S
    # Whole float64 elements are copied (the 5 extra bytes are not); each is read and written.
    assert device_probe.measure_mem_bandwidth(MiB + 5, repeats=3) == pytest.approx(2 * MiB / 1e-3)
    assert clock.readings == 6


def test_gemv_flops_is_the_work_over_the_best_product(clock: FakeTime) -> None:
    clock.steps_s = THREE_TIMINGS_S
    assert device_probe.numpy_gemv_flops(32, 48, repeats=3) == pytest.approx(2 * 32 * 48 / 1e-3)


def readahead(calls: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(off, n) for off, n, advice in calls if advice == os.POSIX_FADV_WILLNEED]


@pytest.mark.parametrize(("n_bytes", "read"), [(MiB + 100, MiB + 100), (10 * MiB, 3 * MiB + 7)])
def test_disk_read_is_the_bytes_streamed_from_the_file_over_the_time(
    tmp_path: Path, clock: FakeTime, fadvised: list[tuple[int, int, int]], n_bytes: int, read: int
) -> None:
    """At most `n_bytes` and at most the file; exactly those bytes are dropped from the page
    cache first, then read in pieces as the prefetch thread reads a layer: readahead for every
    128 KiB of it, in order. The clock moves 1 s per reading, so each 1 MiB piece takes 1 s."""
    path = tmp_path / "blob"
    write_on_disk(path, b"\x01" * (3 * MiB + 7))
    pieces = -(-read // MiB)
    rate = device_probe.measure_disk_read(path, n_bytes, piece_bytes=MiB, max_seconds=10.0)
    assert rate == pytest.approx(read / pieces)
    assert fadvised[0] == (0, read, os.POSIX_FADV_DONTNEED)
    chunks = readahead(fadvised)
    assert chunks[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(chunks))
    assert sum(n for _, n in chunks) == read
    assert max(n for _, n in chunks) == READAHEAD_CHUNK


def test_disk_read_stops_after_max_seconds(
    tmp_path: Path, clock: FakeTime, fadvised: list[tuple[int, int, int]]
) -> None:
    path = tmp_path / "blob"
    write_on_disk(path, b"\x01" * (5 * MiB))
    # 1 s per piece: the third piece ends past 2.5 s, and the probe stops there.
    assert device_probe.measure_disk_read(path, 5 * MiB, piece_bytes=MiB, max_seconds=2.5) == pytest.approx(
        3 * MiB / 3.0
    )
    assert sum(n for _, n in readahead(fadvised)) == 3 * MiB


def test_disk_read_runs_the_load_beside_the_reads(tmp_path: Path, clock: FakeTime) -> None:
    path = tmp_path / "blob"
    write_on_disk(path, b"\x01" * MiB)
    runs: list[int] = []
    device_probe.measure_disk_read(path, MiB, load=lambda: runs.append(1))
    assert runs  # it had started before the first read


def test_disk_read_skips_what_another_mapping_keeps_cached(
    tmp_path: Path, clock: FakeTime, fadvised: list[tuple[int, int, int]]
) -> None:
    """Pages another process maps stay cached through POSIX_FADV_DONTNEED (daemons on one machine
    profile one model file in turn): the probe reads only the pieces that must come from disk."""
    path = tmp_path / "model.gguf"
    write_on_disk(path, b"\x01" * (4 * MiB))
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as other:
        # No readahead past what it touches: the kernel would otherwise cache some of the third
        # piece too (how much depends on the machine), and the probe would rightly skip it.
        other.madvise(mmap.MADV_RANDOM)
        assert sum(other[i] for i in range(0, 2 * MiB, mmap.PAGESIZE)) == 2 * MiB // mmap.PAGESIZE
        rate = device_probe.measure_disk_read(path, 4 * MiB, piece_bytes=MiB, max_seconds=10.0)
        chunks = readahead(fadvised)
    assert rate == pytest.approx(MiB / 1.0)  # 1 s a piece, 1 MiB each
    assert chunks[0][0] == 2 * MiB  # the first two pieces were cached for the other mapping
    assert sum(n for _, n in chunks) == 2 * MiB


def test_disk_read_of_a_file_cached_for_others_reads_a_scratch_file(
    tmp_path: Path, clock: FakeTime, fadvised: list[tuple[int, int, int]]
) -> None:
    path = tmp_path / "model.gguf"
    write_on_disk(path, b"\x01" * (2 * MiB))
    scratch = tmp_path / "scratch"
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as other:
        # No readahead past what it touches: the kernel would otherwise cache some of the third
        # piece too (how much depends on the machine), and the probe would rightly skip it.
        other.madvise(mmap.MADV_RANDOM)
        assert sum(other[i] for i in range(0, 2 * MiB, mmap.PAGESIZE)) == 2 * MiB // mmap.PAGESIZE
        device_probe.measure_disk_read(path, 2 * MiB, piece_bytes=MiB, scratch_dir=scratch)
    assert fadvised[0] == (0, 2 * MiB, os.POSIX_FADV_DONTNEED)  # the model file, to no avail
    assert fadvised[1][2] == os.POSIX_FADV_DONTNEED  # then the scratch file's
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize(("n_bytes", "read"), [(MiB * 5 // 2, 2 * MiB), (1000, 1000)])
def test_disk_read_without_a_path_reads_a_scratch_file_it_removes(
    tmp_path: Path, clock: FakeTime, fadvised: list[tuple[int, int, int]], n_bytes: int, read: int
) -> None:
    """The scratch file holds whole MiB (at least one); the probe reads what it asked for of it."""
    scratch = tmp_path / "scratch"
    assert device_probe.measure_disk_read(None, n_bytes, scratch_dir=scratch) == pytest.approx(read / 1.0)
    assert fadvised[0] == (0, read, os.POSIX_FADV_DONTNEED)
    assert list(scratch.iterdir()) == []


def test_disk_read_of_a_sparse_file_reads_a_scratch_file(
    tmp_path: Path, clock: FakeTime, fadvised: list[tuple[int, int, int]]
) -> None:
    """A node that fetched only its layers holds holes, which read as zeros without the disk."""
    path = tmp_path / "sparse.gguf"
    with open(path, "wb") as fh:
        fh.truncate(8 * MiB)
    scratch = tmp_path / "scratch"
    device_probe.measure_disk_read(path, 3 * MiB + 100, scratch_dir=scratch)
    # The scratch file holds whole MiB: 3 of them, not the 3 MiB + 100 the sparse file has.
    assert fadvised[0] == (0, 3 * MiB, os.POSIX_FADV_DONTNEED)
    assert list(scratch.iterdir()) == []


def test_os_class_names_android_though_it_reports_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_probe.os_class() in OS_CLASSES
    monkeypatch.setenv("ANDROID_ROOT", "/system")
    assert device_probe.os_class() == "android"


def test_profile_is_made_of_the_probes_at_the_given_sizes(tmp_path: Path, clock: FakeTime) -> None:
    clock.steps_s = [1e-3]  # every timed interval is 1 ms
    calls: list[str] = []

    def bench(fmt: str) -> float:
        calls.append(fmt)
        return 1e9

    dev = device_probe.profile_device(
        "me", "127.0.0.1:7070", kernel_bench=bench, sizes=SMALL, net_latency_ms=2.0, scratch_dir=tmp_path
    )
    assert (dev.node_id, dev.address, dev.os) == ("me", "127.0.0.1:7070", device_probe.os_class())
    assert dev.disk_read_bytes_per_s == pytest.approx(SMALL.disk_bytes / 1e-3)
    assert dev.mem_bandwidth_bytes_per_s == pytest.approx(2 * SMALL.mem_bytes / 1e-3)
    assert dev.cpu_flops == {"F32": 1e9}
    assert calls == ["F32"]
    assert dev.ram_total_bytes == device_probe.usable_ram_bytes()[0]  # the host's or its cgroup's
    assert 0 < dev.ram_available_bytes <= dev.ram_total_bytes
    assert 0 <= dev.swap_free_bytes <= dev.swap_total_bytes
    assert dev.net_latency_ms == 2.0
    assert dev.net_bandwidth_bytes_per_s == float("inf")  # not measured here: no limit


def test_profile_round_trips_through_json_the_cache_and_the_wire(tmp_path: Path) -> None:
    """A real measurement (infinite bandwidth included) survives every way a profile travels:
    its JSON, the profile cache on disk, and the Profile RPC's codec."""
    dev = device_probe.profile_device("me", "127.0.0.1:7070", sizes=SMALL, scratch_dir=tmp_path)
    assert DeviceProfile.from_dict(json.loads(json.dumps(dev.to_dict()))) == dev
    wire = codec.node_profile_from_proto(codec.node_profile_to_proto(codec.NodeProfile(dev, 1 << 30, 5.0)))
    assert wire == codec.NodeProfile(dev, 1 << 30, 5.0)
    load_or_measure("me", "ab" * 32, lambda: dev, cache_dir=tmp_path / "profiles")
    cached = load_or_measure(
        "me", "ab" * 32, lambda: pytest.fail("measured again"), cache_dir=tmp_path / "profiles"
    )
    assert cached.from_cache
    # Speeds come from the file; free memory is read afresh, so only it may differ.
    memory = ("ram_total_bytes", "ram_available_bytes", "swap_total_bytes", "swap_free_bytes")
    assert {k: v for k, v in cached.profile.to_dict().items() if k not in memory} == {
        k: v for k, v in dev.to_dict().items() if k not in memory
    }


def test_profile_measures_the_model_file_and_its_formats(
    tmp_path: Path, clock: FakeTime, write_tiny_gguf
) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    calls: list[str] = []

    def bench(fmt: str) -> float:
        calls.append(fmt)
        return 3e9

    steps: list[tuple[int, int, str]] = []
    dev = device_probe.profile_device(
        "me", model_path=path, kernel_bench=bench, sizes=SMALL, on_progress=lambda *s: steps.append(s)
    )
    with GGUFFile(path) as f:
        model = ModelProfile.from_gguf(f)
    # Every format the model's layers and head use, F32 first (the cost model's fallback).
    assert calls == ["F32", *sorted({*model.layer_flops, *model.output_flops} - {"F32"})]
    # Progress: each measurement as it starts, then the end.
    total = 2 + len(calls)
    assert steps == [
        (0, total, "disk read"),
        (1, total, "memory bandwidth"),
        *((2 + i, total, f"compute {fmt}") for i, fmt in enumerate(calls)),
        (total, total, "done"),
    ]
    assert dev.cpu_flops == dict.fromkeys(calls, 3e9)
    # The disk probe read the model file itself (smaller than the probe size), not a scratch file.
    assert dev.disk_read_bytes_per_s == pytest.approx(path.stat().st_size / 1.0)


def test_profile_default_gemv_stands_in_for_every_format(
    tmp_path: Path, clock: FakeTime, write_tiny_gguf
) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    clock.steps_s = [1e-3]
    dev = device_probe.profile_device("me", model_path=path, sizes=SMALL)
    gemv = 2 * SMALL.gemv_rows * SMALL.gemv_cols / 1e-3
    assert dev.cpu_flops == pytest.approx({"F32": gemv, "F16": gemv})


@pytest.mark.parametrize("fmt", ["Q4_K", "F16"])
def test_profiler_measure_formats_always_includes_f32(fmt):
    assert set(device_probe.measure_formats([fmt], lambda f: 2e9)) == {"F32", fmt}
