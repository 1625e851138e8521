"""Which ring members read from the same disk.

Daemons on one machine (a local ring, a docker-compose ring, a desktop running two) stream their
layers from one disk: when both stream at once, each gets a share of its bandwidth, not all of
it as each measured alone, and a plan that counts the whole disk for each predicts such a ring
far faster than it runs. A member reports a key naming its disk
(the kernel's boot id and the whole disk's device number); members with equal keys share one.

A process whose cgroup caps its reads from that disk (cgroup v1 blkio.throttle.read_bps_device,
v2 io.max rbps) has its own share, which its profile measured: it reports no key. That is how
bench/bench_scale.py emulates one disk per device on one machine.
"""

from __future__ import annotations

import os
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PROC = Path("/proc")
SYS_DEV_BLOCK = Path("/sys/dev/block")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def whole_disk(path: str | os.PathLike[str], sys_dev_block: Path = SYS_DEV_BLOCK) -> tuple[int, int]:
    """(major, minor) of the whole disk holding `path`: a partition's parent, since throttles
    and bandwidth belong to the disk."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    entry = sys_dev_block / f"{major}:{minor}"
    if (entry / "partition").exists():
        try:
            parent = ((entry / "..").resolve() / "dev").read_text().split(":")
            major, minor = int(parent[0]), int(parent[1])
        except (OSError, ValueError, IndexError):
            pass
    return major, minor


def reads_throttled(
    disk: tuple[int, int], pid: int | str = "self", proc: Path = PROC, root: Path = CGROUP_ROOT
) -> bool:
    """Whether a cgroup of process `pid` (or one above it) caps its read bandwidth from `disk`."""
    want = f"{disk[0]}:{disk[1]}"
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        hier, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        rel = rel.lstrip("/")
        if "blkio" in controllers.split(","):
            mount, name = root / "blkio", "blkio.throttle.read_bps_device"
        elif hier == "0" and controllers == "":
            mount, name = root, "io.max"
        else:
            continue
        here = mount / rel
        for d in [here, *here.parents]:
            if d != mount and mount not in d.parents:
                break
            if _caps_reads(d / name, want):
                return True
    return False


def _caps_reads(path: Path, disk: str) -> bool:
    """Whether a v1 throttle file ("MAJ:MIN BPS" lines) or a v2 io.max ("MAJ:MIN rbps=N ...")
    names `disk` with a finite read rate."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if not fields or fields[0] != disk:
            continue
        if len(fields) == 2 and fields[1].isdigit():
            return int(fields[1]) > 0
        return any(f.startswith("rbps=") and f != "rbps=max" for f in fields[1:])
    return False


def shared_disk_key(path: str | os.PathLike[str], pid: int | str = "self") -> str:
    """A name for the disk `path` is read from, equal on every process of this machine that
    reads the same disk unthrottled; "" when this process's reads have a cap of their own or
    the disk cannot be told."""
    try:
        disk = whole_disk(path)
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return ""
    if not boot or reads_throttled(disk, pid):
        return ""
    return f"{boot}/{disk[0]}:{disk[1]}"
