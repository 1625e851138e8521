"""How much memory this process may really use: host RAM, the memory cgroup it runs in (a
container's limit, a systemd MemoryMax=, a test's cgroup), and its own footprint.

psutil reports the host's free memory; inside a container or a systemd slice that number can be
gigabytes above what the kernel will let the process hold before it reclaims its page cache or
kills it. A node that plans with the host's number takes layers it cannot keep and thrashes. Both
cgroup versions are read: v2 `memory.max`/`memory.high`, v1 `memory.limit_in_bytes`, walking up
the hierarchy (a parent's limit binds its children too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger("prima.scheduler")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Limits at or above this are "no limit" (v1 reports a page-rounded 2^63 - 1).
_UNLIMITED = 1 << 60
# Leave this share of the memory a node may use to the owner's apps and to what the daemon
# allocates after a plan arrives (relay buffers, logits, numpy temporaries: tens of MiB).
RESERVE_FRACTION = 0.10
# ... and at least this much, for activations, gRPC buffers and the KV cache's first pages.
MIN_RESERVE_BYTES = 64 << 20


@dataclass(frozen=True)
class MemoryLimit:
    """What bounds this process's memory, in bytes."""

    host_total: int
    host_available: int  # psutil's `available`: free + reclaimable page cache
    cgroup_limit: int | None  # the tightest cgroup limit above us, None if none
    cgroup_usage: int  # what the cgroup is charged now (anonymous + page cache)
    cgroup_anon: int  # of which not reclaimable: anonymous memory and shmem
    # ... nor, in practice, file pages mapped now (the code of Python, numpy, numba: reclaimed,
    # they fault straight back); the caller's own model pages are left out (`ours_mapped`)
    cgroup_mapped_file: int
    own_rss: int  # this process's resident set, anonymous part
    source: str  # "host", "cgroup v1 <path>", "cgroup v2 <path>"

    @property
    def available(self) -> int:
        """Bytes this process could still fill with page cache (model weights) before the
        kernel must reclaim: the host's available memory, capped by the cgroup's room."""
        if self.cgroup_limit is None:
            return self.host_available
        room = self.cgroup_limit - self.cgroup_anon - self.cgroup_mapped_file
        return max(0, min(self.host_available, room))

    @property
    def total(self) -> int:
        return min(self.host_total, self.cgroup_limit or self.host_total)

    def weights_budget(self) -> int:
        """Bytes of model weights a node may keep resident: what is available, less a reserve."""
        reserve = max(MIN_RESERVE_BYTES, int(RESERVE_FRACTION * self.total))
        return max(0, self.available - reserve)

    def describe(self) -> str:
        mib = 1 << 20
        if self.cgroup_limit is None:
            return f"{self.host_available / mib:.0f} MiB available of {self.host_total / mib:.0f} MiB (host)"
        return (
            f"{self.available / mib:.0f} MiB available: {self.source} limit {self.cgroup_limit / mib:.0f} MiB, "
            f"{self.cgroup_anon / mib:.0f} MiB of it anonymous and {self.cgroup_mapped_file / mib:.0f} MiB mapped code "
            f"(this process {self.own_rss / mib:.0f} MiB)"
        )


def read_memory_limit(pid: int | str = "self", root: Path = CGROUP_ROOT, ours_mapped: int = 0) -> MemoryLimit:
    """The memory that bounds process `pid`, from /proc and the cgroup filesystem. `ours_mapped`:
    bytes of the model file resident now, which the caller manages itself (not counted as code)."""
    vm = psutil.virtual_memory()
    own = _own_anon_rss(pid)
    limit, usage, anon, mapped, source = None, 0, 0, 0, "host"
    for version, base, path in _cgroup_paths(pid, root):
        found = _read_cgroup(version, base, path)
        if found is not None:
            limit, usage, anon, mapped, where = found
            mapped = max(0, mapped - ours_mapped)
            source = f"cgroup v{version} {where}"
            break
    return MemoryLimit(int(vm.total), int(vm.available), limit, usage, anon, mapped, own, source)


def _own_anon_rss(pid: int | str) -> int:
    try:
        info = psutil.Process(None if pid == "self" else int(pid)).memory_info()
    except (psutil.Error, ValueError):
        return 0
    return int(info.rss - getattr(info, "shared", 0))


def _cgroup_paths(pid: int | str, root: Path) -> list[tuple[int, Path, Path]]:
    """(version, mount, directory) of the memory cgroups `pid` belongs to, v1 first."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[int, Path, Path]] = []
    for line in lines:
        hier, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        rel = rel.lstrip("/")
        if "memory" in controllers.split(","):
            found.insert(0, (1, root / "memory", root / "memory" / rel))
        elif hier == "0" and controllers == "":
            for base in (root / "unified", root):
                if (base / "cgroup.controllers").exists():
                    found.append((2, base, base / rel))
                    break
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _tightest(path: Path, names: tuple[str, ...], mount: Path) -> tuple[int, Path] | None:
    """The smallest limit in `names` files from `path` up to `mount` (a limit above binds too)."""
    best: tuple[int, Path] | None = None
    for p in [path, *path.parents]:
        if p != mount and mount not in p.parents:
            break
        for name in names:
            v = _read_int(p / name)
            if v is not None and v < _UNLIMITED and (best is None or v < best[0]):
                best = (v, p)
    return best


def _read_cgroup(version: int, mount: Path, path: Path) -> tuple[int, int, int, int, str] | None:
    """(limit, usage, anonymous, mapped file, where) of the tightest limit above `path`, None if
    unlimited."""
    limits = ("memory.max", "memory.high") if version == 2 else ("memory.limit_in_bytes",)
    found = _tightest(path, limits, mount)
    if found is None:
        return None
    limit, where = found
    usage = _read_int(where / ("memory.current" if version == 2 else "memory.usage_in_bytes")) or 0
    stat = _stat(where / "memory.stat")
    if version == 2:
        anon = stat.get("anon", 0) + stat.get("shmem", 0)
        mapped = stat.get("file_mapped", 0)
    else:
        anon = stat.get("total_rss", stat.get("rss", 0)) + stat.get("total_shmem", stat.get("shmem", 0))
        mapped = stat.get("total_mapped_file", stat.get("mapped_file", 0))
    return limit, usage, anon, mapped, "/" + str(where.relative_to(mount))


def process_major_faults(pid: int | str = "self") -> int:
    """Major page faults of `pid` so far (each one a synchronous read from disk)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[9])  # field 12 of stat(5), counted after the ") " that ends comm
