"""A daemon in a memory cgroup (a container, a systemd MemoryMax=, a small device emulated here)
plans with that limit, not the host's RAM, with no --mem-budget anywhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prima.coordinator.emulate import EmulatedDevice, cgroups_writable
from prima.coordinator.ring import Ring
from prima.net.client import NodeClient

from .conftest import reference_tokens, ring_tokens, start_ring

pytestmark = pytest.mark.slow

MiB = 1 << 20
LIMIT = 400 * MiB


def test_daemon_in_a_cgroup_plans_with_its_limit(
    smollm2_path: Path, ring_logs: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    why = cgroups_writable()
    if why:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    prompt = next(p["prompt_token_ids"] for p in oracle("smollm2-135m")["prompts"] if p["name"] == "capital")
    expected = reference_tokens(smollm2_path, prompt)
    small = EmulatedDevice("test-daemon-cgroup", LIMIT)
    try:
        for local in start_ring(2, smollm2_path, ring_logs / "cgroup", preexec=[None, small.preexec()]):
            client = NodeClient(local.addresses[1])
            try:
                found = client.profile()
            finally:
                client.close()
            # No budget flag anywhere: node1 takes its half of the layers within its cgroup.
            ring = Ring.connect(local.addresses, window_sizes=[15, 15])
            try:
                tokens = ring_tokens(ring, prompt)
                info = ring.clients[1].info()
            finally:
                ring.close()
    finally:
        small.remove()
    assert tokens == expected
    assert found.device.ram_total_bytes == LIMIT
    assert 0 < found.device.ram_available_bytes < LIMIT
    assert found.mem_budget_bytes == 0  # auto: what the cgroup leaves, not a number given
    assert info.residency is not None
    assert 0 < info.residency.budget_bytes < LIMIT
