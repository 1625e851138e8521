"""A node's DeviceProfile kept on disk between runs, so planning does not re-measure every time.

Speeds (kernels, memory bandwidth, disk) change rarely and take up to a second to measure; they
are cached per (node id, model file) with the time they were measured. Free RAM and swap change
all the time: they are read afresh on every lookup. `refresh=True` (primad --reprofile) measures
again. A cache file that cannot be read is measured over, never trusted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from prima import paths
from prima.errors import InputError
from prima.scheduler.device_probe import usable_ram_bytes
from prima.scheduler.profile_schema import DeviceProfile

log = logging.getLogger("prima.scheduler")

CACHE_ENV = "PRIMA_PROFILE_CACHE"
# Which probes measured a cached profile; a profile from other probes is measured again.
# 2: the disk probe streams in the prefetcher's pattern beside a compute load.
PROBE_VERSION = 2
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_cache_dir() -> Path:
    """`$PRIMA_PROFILE_CACHE`, else profiles/ under prima's cache (prima.paths)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else paths.profiles_dir()


@dataclass(frozen=True)
class CachedProfile:
    profile: DeviceProfile
    measured_unix_s: float
    from_cache: bool


def cache_path(cache_dir: Path, node_id: str, model_fingerprint: str) -> Path:
    name = _UNSAFE.sub("-", node_id)[:64] or "node"
    return cache_dir / f"{name}-{model_fingerprint[:12] or 'nomodel'}.json"


def load_or_measure(
    node_id: str,
    model_fingerprint: str,
    measure: Callable[[], DeviceProfile],
    *,
    refresh: bool = False,
    cache_dir: Path | None = None,
    clock: Callable[[], float] = time.time,
) -> CachedProfile:
    """The cached profile of this node for this model file with current free RAM and swap, or a
    new measurement (stored for next time) when there is none, it is unreadable, or `refresh`."""
    path = cache_path(cache_dir or default_cache_dir(), node_id, model_fingerprint)
    if not refresh:
        cached = _read(path)
        if cached is not None:
            profile, measured = cached
            return CachedProfile(_with_current_memory(profile, node_id), measured, True)
    profile = dataclasses.replace(measure(), node_id=node_id)
    measured = clock()
    _write(path, profile, measured)
    return CachedProfile(profile, measured, False)


def _read(path: Path) -> tuple[DeviceProfile, float] | None:
    try:
        doc = json.loads(path.read_text())
        if doc.get("probe_version") != PROBE_VERSION:
            log.info("the cached profile %s is from older probes; measuring again", path)
            return None
        measured = float(doc["measured_unix_s"])
        return DeviceProfile.from_dict(doc["profile"]), measured
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, InputError) as exc:
        log.warning("ignoring the cached profile %s (%s); measuring again", path, exc)
        return None


def _write(path: Path, profile: DeviceProfile, measured: float) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {"probe_version": PROBE_VERSION, "measured_unix_s": measured, "profile": profile.to_dict()},
                indent=2,
            )
        )
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not cache the profile in %s: %s", path, exc)


def _with_current_memory(profile: DeviceProfile, node_id: str) -> DeviceProfile:
    total, usable = usable_ram_bytes()
    swap = psutil.swap_memory()
    return dataclasses.replace(
        profile,
        node_id=node_id,
        ram_total_bytes=total,
        ram_available_bytes=usable,
        swap_total_bytes=int(swap.total),
        swap_free_bytes=int(swap.free),
    )
