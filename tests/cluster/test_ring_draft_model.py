"""A draft model on a ring of real primad processes: only the head has one (`primad
--draft-model`), drafts there and sends the last token and its drafts round the ring as one
micro-batch; the tokens are the single device's plain decoding, greedy and seeded. A head
without a draft model, or with another one than asked for, refuses and keeps serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.errors import NodeError
from prima.forward.loader import load_model
from prima.model.gguf_file import GGUFFile
from tests.conftest import REPEAT_TEXT, tiny_model_path

from .conftest import N_CTX, UBATCH, reference_tokens, ring_request, start_ring

pytestmark = pytest.mark.slow

SEEDED = SamplerConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def drafting_ring(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    """Two SmolLM2 daemons; node0 drafts with SmolLM2 itself (most drafts kept; its prompt is
    prefilled in other micro-batches than the ring's, so near-ties may be rejected)."""
    yield from start_ring(
        2,
        smollm2_path,
        ring_logs / "draft-model",
        node_args=[("--draft-model", str(smollm2_path)), ()],
    )


def _draft(model_path: Path) -> DraftConfig:
    return DraftConfig("model", 3, GGUFFile(model_path).fingerprint())


def _events(ring: Ring, request: GenerateRequest) -> tuple[list[int], GenerationDone]:
    events = list(ring.generate(request))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    return [t for t in events if isinstance(t, int)], done


def test_model_drafts_on_a_ring_equal_single_device(
    drafting_ring: LocalRing, smollm2_path: Path, oracle: Callable[[str], dict[str, Any]]
) -> None:
    tokenizer = load_model(smollm2_path, layers=range(0)).tokenizer
    stops = sorted(tokenizer.stop_ids)
    prompts = [p["prompt_token_ids"] for p in oracle("smollm2-135m")["prompts"]]
    draft = _draft(smollm2_path)
    ring = Ring.connect(drafting_ring.addresses, rounds=1)
    drafted = accepted = 0
    try:
        for ids in [*prompts, prompt_ids(tokenizer, REPEAT_TEXT)]:
            got, done = _events(ring, replace(ring_request(ids, MAX_TOKENS, stops), draft=draft))
            assert got == reference_tokens(smollm2_path, ids, MAX_TOKENS), f"prompt {ids[:8]}..."
            assert done.accepted_tokens <= done.draft_tokens
            drafted += done.draft_tokens
            accepted += done.accepted_tokens
        # Seeded sampling: every position drawn with plain decoding's randomness.
        loaded = load_model(smollm2_path, mode="exact")
        for ids in prompts[:2]:
            plain = replace(ring_request(ids, MAX_TOKENS, stops), sampler=SEEDED)
            engine = LocalEngine(loaded.model, n_ctx=N_CTX, ubatch=UBATCH)
            want = [t for t in sample_tokens(engine, plain) if isinstance(t, int)]
            got, _ = _events(ring, replace(plain, draft=draft))
            assert got == want, f"seeded, prompt {ids[:8]}..."
    finally:
        ring.close()
    assert accepted > 0


def test_a_head_refuses_another_draft_model_and_keeps_serving(
    drafting_ring: LocalRing, smollm2_path: Path
) -> None:
    ids = [1, 504, 3575, 282, 4649, 314]
    ring = Ring.connect(drafting_ring.addresses, rounds=1)
    try:
        other = DraftConfig("model", 3, GGUFFile(tiny_model_path("tiny-qwen2")).fingerprint())
        with pytest.raises(NodeError, match="node0 \\(the ring's head\\) drafts with .*--draft-model"):
            _events(ring, replace(ring_request(ids, 4), draft=other))
        got, done = _events(ring, replace(ring_request(ids, 4), draft=DraftConfig("model", 3)))
        assert got == reference_tokens(smollm2_path, ids, 4)
        assert done.draft_tokens > 0
    finally:
        ring.close()
    # node1 as the head: it has no draft model.
    ring = Ring.connect(list(reversed(drafting_ring.addresses)), rounds=1)
    try:
        with pytest.raises(NodeError, match="node1 \\(the ring's head\\) has no draft model.*--draft-model"):
            _events(ring, replace(ring_request(ids, 4), draft=DraftConfig("model", 3)))
        assert _events(ring, ring_request(ids, 4))[0] == reference_tokens(smollm2_path, ids, 4)
    finally:
        ring.close()
