"""Emulate small devices on one machine: each process in its own memory cgroup, optionally with
its own disk-read throttle (cgroups v1, as root).

A home cluster is several devices, each with its own RAM and its own disk. On one test machine
every daemon shares both, so a ring looks better or worse than it would be. A memory cgroup
gives each process a real limit (the kernel reclaims its page cache or kills it, as on a small
device), and a blkio throttle gives each the read bandwidth of its own disk, so llama.cpp alone
and a ring of N are compared as one device against N of them.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prima.errors import PrimaError
from prima.scheduler.disk_sharing import whole_disk

CGROUP_V1 = Path("/sys/fs/cgroup")


class CgroupUnavailable(PrimaError):
    """cgroups v1 memory/blkio are not writable here (not root, or a v2-only system)."""


def cgroups_writable(root: Path = CGROUP_V1) -> str | None:
    """None if memory (and blkio) cgroups can be created here, else the reason why not."""
    mem = root / "memory"
    if not (mem / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {mem}"
    if not os.access(mem, os.W_OK):
        return f"{mem} is not writable (run as root)"
    return None


@dataclass
class EmulatedDevice:
    """A memory cgroup (and blkio group) for one emulated device; `join` moves a process in."""

    name: str
    mem_limit_bytes: int
    read_bytes_per_s: int = 0  # 0 = the machine's own disk speed
    device: tuple[int, int] | None = None  # (major, minor) of the disk to throttle
    root: Path = CGROUP_V1

    def __post_init__(self) -> None:
        why = cgroups_writable(self.root)
        if why:
            raise CgroupUnavailable(why)
        self.mem_dir = self.root / "memory" / "prima-emulate" / self.name
        self.mem_dir.mkdir(parents=True, exist_ok=True)
        # Without swap the limit is the memory; set it after clearing any previous usage.
        (self.mem_dir / "memory.limit_in_bytes").write_text(str(self.mem_limit_bytes))
        # A blkio group counts the bytes read (and throttles them when asked).
        self.blkio_dir: Path | None = None
        blkio = self.root / "blkio"
        if self.device and os.access(blkio, os.W_OK):
            self.blkio_dir = blkio / "prima-emulate" / self.name
            self.blkio_dir.mkdir(parents=True, exist_ok=True)
            major, minor = self.device
            (self.blkio_dir / "blkio.throttle.read_bps_device").write_text(
                f"{major}:{minor} {self.read_bytes_per_s}"
            )

    def join(self, pid: int | None = None) -> None:
        """Move `pid` (default: the calling process) into this device's groups."""
        who = str(pid or os.getpid())
        (self.mem_dir / "cgroup.procs").write_text(who)
        if self.blkio_dir:
            (self.blkio_dir / "cgroup.procs").write_text(who)

    def preexec(self) -> Callable[[], None]:
        """For subprocess.Popen(preexec_fn=...): the child joins before it execs, so every page
        it ever touches is charged here."""
        return self.join

    def peak_bytes(self) -> int:
        return int((self.mem_dir / "memory.max_usage_in_bytes").read_text())

    def reset_peak(self) -> None:
        (self.mem_dir / "memory.max_usage_in_bytes").write_text("0")

    def read_bytes(self) -> int:
        """Bytes read from disk by this group so far (blkio accounting; 0 without a blkio group)."""
        if not self.blkio_dir:
            return 0
        total = 0
        for line in (self.blkio_dir / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "Read":
                total += int(parts[2])
        return total

    def remove(self) -> None:
        """Delete the groups (bounded wait for their processes to be gone)."""
        for d in (self.mem_dir, self.blkio_dir):
            if d is None:
                continue
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def disk_of(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(major, minor) of the whole disk holding `path` (blkio throttles whole disks)."""
    return whole_disk(path)


def drop_page_cache() -> bool:
    """Write back dirty pages and empty the page cache (root only); False if not permitted."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True
