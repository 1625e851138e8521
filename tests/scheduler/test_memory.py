"""What bounds a process's memory: cgroup v1 and v2 limits (the tightest up the hierarchy), the
anonymous memory already charged, and a real cgroup when this machine lets tests make one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prima.coordinator.emulate import EmulatedDevice, cgroups_writable
from prima.scheduler.memory import MIN_RESERVE_BYTES, MemoryLimit, _read_cgroup

MiB = 1 << 20


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)


def test_v1_takes_the_tightest_limit_up_the_hierarchy(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    _write(mount, memory__limit_in_bytes=str(2**63 - 4096))
    _write(
        mount / "slice",
        memory__limit_in_bytes=str(600 * MiB),
        memory__usage_in_bytes=str(300 * MiB),
        memory__stat=f"total_rss {180 * MiB}\ntotal_cache {100 * MiB}\ntotal_shmem 0\ntotal_mapped_file {20 * MiB}\n",
    )
    _write(mount / "slice" / "node", memory__limit_in_bytes=str(2**63 - 4096))
    limit, usage, anon, mapped, where = _read_cgroup(1, mount, mount / "slice" / "node")
    assert mapped == 20 * MiB
    assert (limit, usage, anon, where) == (600 * MiB, 300 * MiB, 180 * MiB, "/slice")


def test_v2_reads_max_and_high_and_ignores_max(tmp_path: Path) -> None:
    _write(tmp_path, cgroup__controllers="memory")
    _write(
        tmp_path / "box",
        memory__max="max",
        memory__high=str(450 * MiB),
        memory__current=str(50 * MiB),
        memory__stat=f"anon {38 * MiB}\nfile {10 * MiB}\nshmem {1 * MiB}\nfile_mapped {2 * MiB}\n",
    )
    assert _read_cgroup(2, tmp_path, tmp_path / "box") == (450 * MiB, 50 * MiB, 39 * MiB, 2 * MiB, "/box")
    _write(tmp_path / "free", memory__max="max")
    assert _read_cgroup(2, tmp_path, tmp_path / "free") is None


def test_available_is_the_cgroup_room_not_the_hosts() -> None:
    lim = MemoryLimit(
        host_total=24 << 30,
        host_available=20 << 30,
        cgroup_limit=450 * MiB,
        cgroup_usage=300 * MiB,
        cgroup_anon=100 * MiB,
        cgroup_mapped_file=20 * MiB,
        own_rss=100 * MiB,
        source="cgroup v1 /x",
    )
    # Page cache in the group can be reclaimed for weights; anonymous memory and mapped code cannot.
    assert lim.available == 330 * MiB
    assert lim.total == 450 * MiB
    assert lim.weights_budget() == 330 * MiB - MIN_RESERVE_BYTES
    host = MemoryLimit(8 << 30, 6 << 30, None, 0, 0, 0, 100 * MiB, "host")
    assert host.available == 6 << 30
    assert host.weights_budget() == (6 << 30) - int(0.10 * (8 << 30))


PROBE = (
    "import json; from prima.scheduler.memory import read_memory_limit as r; m = r(); "
    "print(json.dumps([m.cgroup_limit, m.total, m.weights_budget()]))"
)


def test_a_process_in_a_memory_cgroup_sees_its_limit() -> None:
    why = cgroups_writable()
    if why:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    dev = EmulatedDevice("test-memory-probe", 300 * MiB)
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE],
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=dev.preexec(),
            timeout=60,
        )
    finally:
        dev.remove()
    limit, total, budget = json.loads(out.stdout)
    assert limit == total == 300 * MiB
    assert 0 < budget < 300 * MiB - MIN_RESERVE_BYTES
