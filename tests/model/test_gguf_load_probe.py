"""Corrupted copies of SmolLM2 loaded and run each in a child process of its own, within 10 s
and a resident-memory cap: each is refused with a PrimaError or gives the original's tokens and
logits (or, with the original's geometry, other numbers from a corrupted hyperparameter); none
hangs, crashes, runs with other shapes, or passes the cap. A CI-sized count here; the full 300
with `python -m tests.model.gguf_load_probe` (docs/security.md has its numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model import gguf_load_probe
from tests.model.gguf_corruptions import Corruption, apply

pytestmark = pytest.mark.slow

CASES = 6
SEED = 38


def test_seeded_corruptions_are_refused_or_run_as_the_original(smollm2_path: Path, tmp_path: Path) -> None:
    report = gguf_load_probe.probe(smollm2_path, CASES, SEED, tmp_path)
    assert not report.bad(), [f"{c}: {o.kind} {o.detail}" for c, o in report.bad()]
    counts = report.counts()
    assert counts["refused"] >= 1, counts  # the corruptions reach the checks
    assert sum(counts.values()) == CASES


def test_a_block_count_of_one_is_refused_not_run_as_a_one_layer_model(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """llama.block_count 30 -> 1 once loaded and ran as a one-layer model (issue 38)."""
    work = tmp_path / "m.gguf"
    work.write_bytes(smollm2_path.read_bytes())
    key = b"llama.block_count"
    header = smollm2_path.read_bytes()[: 1 << 20]
    at = header.index(key) + len(key) + 4  # past the value type: the uint32 value
    assert int.from_bytes(header[at : at + 4], "little") == 30
    apply(work, Corruption("field", at, (1).to_bytes(4, "little")))
    outcome = gguf_load_probe.run_child(work)
    assert outcome.kind == "refused", outcome
    assert "block_count" in outcome.detail
