"""A model split across real primad processes gives exactly the tokens of the whole model on one
device: 2, 3 and 4 nodes, one and several rounds, both test models. One 4-daemon ring per model
is started per module and re-planned (LoadPlan with a new epoch) for each case."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerationDone
from prima.engine.prompt import prompt_ids
from prima.engine.speculative import DraftConfig
from prima.forward.loader import load_model
from prima.plan import plan_from_layer_counts
from tests.conftest import REPEAT_TEXT

from .conftest import reference_tokens, ring_request, ring_tokens, start_ring

pytestmark = pytest.mark.slow

# (nodes, rounds) per model: every ring size with one round and with several; rounds divide the
# layer count (smollm2: 30, gemma3: 18). Every oracle prompt of the model is run on each.
CASES = [(2, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 3)]


@pytest.fixture(scope="module")
def smollm2_ring(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(4, smollm2_path, ring_logs / "smollm2")


@pytest.fixture(scope="module")
def gemma3_ring(gemma3_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(4, gemma3_path, ring_logs / "gemma3")


def _prompt_ids(oracle: Callable[[str], dict[str, Any]], tag: str, name: str) -> list[int]:
    return next(p["prompt_token_ids"] for p in oracle(tag)["prompts"] if p["name"] == name)


def _check_model(
    local_ring: LocalRing, model_path: Path, tag: str, oracle: Callable[[str], dict[str, Any]]
) -> None:
    stops = sorted(load_model(model_path, layers=range(0)).tokenizer.stop_ids)
    names = [p["name"] for p in oracle(tag)["prompts"]]
    expected = {name: reference_tokens(model_path, _prompt_ids(oracle, tag, name)) for name in names}
    for n_nodes, rounds in CASES:
        ring = Ring.connect(local_ring.addresses[:n_nodes], rounds=rounds)
        try:
            assert len(ring.plan.hops()) == n_nodes * rounds
            for name in names:
                got = ring_tokens(ring, _prompt_ids(oracle, tag, name), stop_ids=stops)
                assert got == expected[name], f"{n_nodes} nodes, {rounds} round(s), prompt {name}"
        finally:
            ring.close()


def test_smollm2_ring_equals_single_device(
    smollm2_ring: LocalRing, smollm2_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    _check_model(smollm2_ring, smollm2_path, "smollm2-135m", oracle)


def test_gemma3_ring_equals_single_device(
    gemma3_ring: LocalRing, gemma3_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    _check_model(gemma3_ring, gemma3_path, "gemma3-270m", oracle)


def test_hand_windows_equal_single_device(
    smollm2_ring: LocalRing, smollm2_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    """Uneven hand-set windows over three rounds."""
    prompt = _prompt_ids(oracle, "smollm2-135m", "capital")
    expected = reference_tokens(smollm2_path, prompt)
    ring = Ring.connect(smollm2_ring.addresses[:3], window_sizes=[2, 4, 4], rounds=3)
    try:
        stops = sorted(load_model(smollm2_path, layers=range(0)).tokenizer.stop_ids)
        assert ring_tokens(ring, prompt, stop_ids=stops) == expected
        assert [n.windows[0].n_layers for n in ring.plan.nodes] == [2, 4, 4]
    finally:
        ring.close()


def test_layer_counts_that_are_not_multiples_of_the_rounds_equal_single_device(
    smollm2_ring: LocalRing, smollm2_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    """Halda's plans where a node's layers a token need not be a multiple of k: its windows
    differ by a layer between rounds, and a node with fewer layers than rounds sits some out."""
    prompt = _prompt_ids(oracle, "smollm2-135m", "capital")
    expected = reference_tokens(smollm2_path, prompt)
    ring = Ring.connect(smollm2_ring.addresses[:3], rounds=1)
    try:
        nodes = [(n.node_id, n.address) for n in ring.plan.nodes]
        plan = plan_from_layer_counts(nodes, [17, 11, 2], 4, 30, epoch=ring.plan.epoch + 1)
        assert [[w.n_layers for w in n.windows] for n in plan.nodes] == [
            [4, 4, 4, 5],
            [2, 3, 3, 3],
            [0, 0, 1, 1],
        ]
        ring.load_plan(plan)
        stops = sorted(load_model(smollm2_path, layers=range(0)).tokenizer.stop_ids)
        assert ring_tokens(ring, prompt, stop_ids=stops) == expected
        assert [i.windows for i in ring.info()] == [n.windows for n in plan.nodes]
    finally:
        ring.close()


def test_info_reports_plan_and_residency(smollm2_ring: LocalRing) -> None:
    ring = Ring.connect(smollm2_ring.addresses[:2], rounds=3)
    try:
        infos = ring.info()
        assert {i.plan_epoch for i in infos} == {ring.plan.epoch}
        for info, node in zip(infos, ring.plan.nodes, strict=True):
            assert info.windows == node.windows
            assert info.residency is not None
            assert 0 < info.residency.owned_bytes
            assert info.residency.resident_bytes <= info.residency.owned_bytes + 4096 * len(node.windows)
    finally:
        ring.close()


def _check_drafts(
    local_ring: LocalRing, model_path: Path, tag: str, oracle: Callable[[str], dict[str, Any]]
) -> None:
    """Speculative decoding on 3 nodes: the head sends the last token and its drafts round the
    ring as one micro-batch and gets every row back; the tokens are the single device's."""
    tokenizer = load_model(model_path, layers=range(0)).tokenizer
    stops = sorted(tokenizer.stop_ids)
    prompts = [p["prompt_token_ids"] for p in oracle(tag)["prompts"]]
    ring = Ring.connect(local_ring.addresses[:3], rounds=1)
    accepted = 0
    try:
        for ids in [*prompts, prompt_ids(tokenizer, REPEAT_TEXT)]:
            request = replace(ring_request(ids, 16, stops), draft=DraftConfig("lookup", 3))
            events = list(ring.generate(request))
            done = events[-1]
            assert isinstance(done, GenerationDone)
            got = [t for t in events if isinstance(t, int)]
            assert got == reference_tokens(model_path, ids, 16), f"prompt {ids[:8]}..."
            assert done.accepted_tokens <= done.draft_tokens
            accepted += done.accepted_tokens
    finally:
        ring.close()
    assert accepted > 0


def test_smollm2_drafts_on_a_ring_equal_single_device(
    smollm2_ring: LocalRing, smollm2_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    _check_drafts(smollm2_ring, smollm2_path, "smollm2-135m", oracle)


def test_gemma3_drafts_on_a_ring_equal_single_device(
    gemma3_ring: LocalRing, gemma3_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    _check_drafts(gemma3_ring, gemma3_path, "gemma3-270m", oracle)
