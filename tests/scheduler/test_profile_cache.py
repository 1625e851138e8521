"""A node's profile is measured once per model file, then served from disk with fresh free RAM."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from prima.scheduler.profile_cache import PROBE_VERSION, cache_path, load_or_measure
from prima.scheduler.profile_schema import DeviceProfile

FP = "ab" * 32


def _counting(make_device: Callable[..., DeviceProfile]) -> tuple[list[int], Callable[[], DeviceProfile]]:
    calls: list[int] = []

    def measure() -> DeviceProfile:
        calls.append(1)
        return make_device("measured-as", ram_gib=1.0)

    return calls, measure


def test_profile_is_measured_once_then_cached(tmp_path: Path, make_device) -> None:
    calls, measure = _counting(make_device)
    first = load_or_measure("node0", FP, measure, cache_dir=tmp_path, clock=lambda: 100.0)
    second = load_or_measure("node0", FP, measure, cache_dir=tmp_path, clock=lambda: 200.0)
    assert len(calls) == 1
    assert not first.from_cache
    assert second.from_cache
    assert second.measured_unix_s == first.measured_unix_s == 100.0
    assert second.profile.node_id == first.profile.node_id == "node0"
    assert second.profile.cpu_flops == first.profile.cpu_flops
    # Free memory is read now, not taken from the file.
    assert second.profile.ram_available_bytes != first.profile.ram_available_bytes


def test_refresh_and_another_model_measure_again(tmp_path: Path, make_device) -> None:
    calls, measure = _counting(make_device)
    load_or_measure("node0", FP, measure, cache_dir=tmp_path)
    again = load_or_measure("node0", FP, measure, cache_dir=tmp_path, refresh=True, clock=lambda: 300.0)
    load_or_measure("node0", "cd" * 32, measure, cache_dir=tmp_path)
    assert len(calls) == 3
    assert again.measured_unix_s == 300.0


def test_unreadable_cache_is_measured_over(tmp_path: Path, make_device) -> None:
    calls, measure = _counting(make_device)
    path = cache_path(tmp_path, "node0", FP)
    path.write_text(
        json.dumps({"probe_version": PROBE_VERSION, "measured_unix_s": 1, "profile": {"node_id": 3}})
    )
    found = load_or_measure("node0", FP, measure, cache_dir=tmp_path)
    assert len(calls) == 1
    assert not found.from_cache
    assert load_or_measure("node0", FP, measure, cache_dir=tmp_path).from_cache


def test_a_profile_from_older_probes_is_measured_again(tmp_path: Path, make_device) -> None:
    """A cache written before the disk probe streamed like the prefetcher holds a disk speed
    the planner would trust wrongly."""
    calls, measure = _counting(make_device)
    load_or_measure("node0", FP, measure, cache_dir=tmp_path)
    path = cache_path(tmp_path, "node0", FP)
    doc = json.loads(path.read_text())
    del doc["probe_version"]
    path.write_text(json.dumps(doc))
    assert not load_or_measure("node0", FP, measure, cache_dir=tmp_path).from_cache
    assert len(calls) == 2
