"""Which ring members read one disk: the key names the machine and the whole disk, and a process
whose cgroup caps its reads from that disk has a share of its own (no key). Cgroup files are
parsed from a tree made here, and read from a real cgroup where this machine lets tests make one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prima.coordinator.emulate import EmulatedDevice, cgroups_writable
from prima.scheduler.disk_sharing import reads_throttled, shared_disk_key, whole_disk

MiB = 1 << 20


def _tree(tmp_path: Path, cgroup_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /proc/<pid>/cgroup holding `cgroup_line`, and a cgroup root with `files`."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_a_v1_throttle_on_the_disk_or_above_it_counts(tmp_path: Path) -> None:
    proc, root = _tree(
        tmp_path,
        "5:blkio:/bench/node0",
        {"blkio/bench/blkio.throttle.read_bps_device": "8:0 209715200\n"},
    )
    assert reads_throttled((8, 0), 7, proc, root)
    assert not reads_throttled((259, 0), 7, proc, root)  # another disk's throttle is not ours


def test_v2_io_max_counts_only_a_read_rate(tmp_path: Path) -> None:
    proc, root = _tree(
        tmp_path,
        "0::/box",
        {
            "cgroup.controllers": "io memory",
            "box/io.max": "8:0 rbps=max wbps=1048576\n259:0 rbps=104857600 wbps=max\n",
        },
    )
    assert reads_throttled((259, 0), 7, proc, root)
    assert not reads_throttled((8, 0), 7, proc, root)  # writes capped, reads not


def test_processes_here_share_a_key_naming_this_machines_disk(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    key = shared_disk_key(f)
    major, minor = whole_disk(f)
    assert key.endswith(f"/{major}:{minor}")
    assert key.split("/")[0] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


PROBE = "import sys; from prima.scheduler.disk_sharing import shared_disk_key as k; print(k(sys.argv[1]))"


@pytest.mark.parametrize("read_mib_per_s", [0, 100])
def test_a_process_with_a_real_read_throttle_has_a_disk_of_its_own(
    tmp_path: Path, read_mib_per_s: int
) -> None:
    why = cgroups_writable()
    if why:
        pytest.skip(f"cannot create a cgroup here: {why}")
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    dev = EmulatedDevice(f"test-disk-{read_mib_per_s}", 300 * MiB, read_mib_per_s * MiB, whole_disk(f))
    if dev.blkio_dir is None:
        dev.remove()
        pytest.skip("the blkio controller is not writable here")
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(f)],
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=dev.preexec(),
            timeout=60,
        )
    finally:
        dev.remove()
    expected = "" if read_mib_per_s else shared_disk_key(f)
    assert out.stdout.strip() == expected
