"""A node that vanishes mid-session is named in a NodeError (no hang); a node whose --mem-budget
is below its layers keeps its resident weights within the budget and the output unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.errors import NodeError
from prima.weights.window import PAGE

from .conftest import reference_tokens, ring_tokens, start_ring

pytestmark = pytest.mark.slow

ROUNDS = 3
SLACK_BYTES = 64 * PAGE  # read-around at span edges


@pytest.fixture
def three_nodes(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(3, smollm2_path, ring_logs / "failure")


def test_vanished_node_is_named(three_nodes: LocalRing) -> None:
    ring = Ring.connect(three_nodes.addresses)
    try:
        assert len(ring_tokens(ring, [1, 2, 3], 2)) == 2
        three_nodes.kill(2)
        with pytest.raises(NodeError, match="node2"):
            ring_tokens(ring, [1, 2, 3], 2)
    finally:
        ring.close()


def test_mem_budget_keeps_weights_resident_within_it(
    smollm2_path: Path, private_copy: Path, ring_logs: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    prompt = next(p["prompt_token_ids"] for p in oracle("smollm2-135m")["prompts"] if p["name"] == "capital")
    expected = reference_tokens(smollm2_path, prompt)
    # node1 owns 15 layers in 3 windows of 5 (~11 MB each); give it room for about two windows.
    budget = 24 << 20
    for local in start_ring(
        2,
        smollm2_path,
        ring_logs / "budget",
        models=[smollm2_path, private_copy],
        mem_budgets=["", str(budget)],
    ):
        ring = Ring.connect(local.addresses, rounds=ROUNDS)
        try:
            tokens = ring_tokens(ring, prompt)
            res = ring.clients[1].info().residency
        finally:
            ring.close()
    assert tokens == expected
    assert res is not None
    assert res.budget_bytes == budget
    assert res.owned_bytes > budget
    assert res.releases > 0
    assert 0 < res.peak_resident_bytes <= budget + SLACK_BYTES
    assert res.resident_bytes <= budget + SLACK_BYTES
