"""qwen2 and qwen3 across real primad processes against llama.cpp: the tiny Qwen models on a
2- and a 3-daemon ring, in exact mode and in the default q8 mode. Each oracle prompt's last-token
logits must be within 1e-3 of llama.cpp's `f32` run in exact mode, and in q8 mode (F32 weights:
computed exactly too, but a KV cache of halves) within 1e-2 of its `quant` run, whose KV cache is
of halves too; the greedy ids equal llama.cpp's (the head samples; the prompt's logits come back once, with the
end of the generation). One 3-daemon ring per model and mode, re-planned per size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerationDone, generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from tests.conftest import load_tiny_oracle, tiny_model_path
from tests.tiny_models import write_tiny_model
from tests.tiny_qwen import TINY_TAGS

from .conftest import N_CTX, ring_request, ring_tokens, start_ring

pytestmark = pytest.mark.slow

F32_TOLERANCE = 1e-3
# A float16 KV cache: float32 noise at a boundary of the half grid flips a value to its neighbour
# (tests/model/test_tiny_qwen.py measured up to ~6e-3).
F16_KV_TOLERANCE = 1e-2
GREEDY = SamplerConfig()
# The tiny models' end-of-text and end-of-turn ids (SmolLM2's vocabulary).
STOP_IDS = [0, 2]
MODE_ARGS = {"exact": ("--exact",), "q8": ()}


@pytest.fixture(
    scope="module", params=[(t, m) for t in TINY_TAGS for m in MODE_ARGS], ids=lambda p: f"{p[0]}-{p[1]}"
)
def tiny_ring(request: pytest.FixtureRequest, ring_logs: Path) -> Iterator[tuple[str, str, LocalRing]]:
    tag, mode = request.param
    for ring in start_ring(3, tiny_model_path(tag), ring_logs / f"{tag}-{mode}", extra_args=MODE_ARGS[mode]):
        yield tag, mode, ring


def _check(ring: Ring, prompt: dict[str, Any], mode: str) -> None:
    run = prompt["f32" if mode == "exact" else "quant"]
    expected = run["greedy_token_ids"]
    request = ring_request(prompt["prompt_token_ids"], len(expected), STOP_IDS, want_prompt_logits=True)
    events = list(ring.generate(request))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    assert [t for t in events if isinstance(t, int)] == expected
    want = run["logits"]
    assert done.prompt_logits is not None
    tolerance = F32_TOLERANCE if mode == "exact" else F16_KV_TOLERANCE
    assert np.abs(np.asarray(done.prompt_logits) - want).max() <= tolerance


@pytest.mark.parametrize(("n_nodes", "rounds"), [(2, 1), (3, 1), (2, 2)])
def test_tiny_qwen_ring_matches_llama_cpp(
    tiny_ring: tuple[str, str, LocalRing], n_nodes: int, rounds: int
) -> None:
    tag, mode, local_ring = tiny_ring
    ring = Ring.connect(local_ring.addresses[:n_nodes], rounds=rounds)
    try:
        assert len(ring.plan.hops()) == n_nodes * rounds
        for prompt in load_tiny_oracle(tag)["prompts"]:
            _check(ring, prompt, mode)
    finally:
        ring.close()


def test_daemons_serve_a_vocabulary_prima_cannot_tokenize(tmp_path: Path, ring_logs: Path) -> None:
    """Daemons never build the tokenizer (only the coordinator does), so an unknown
    pre-tokenizer does not stop a ring from computing what one device computes."""
    path = write_tiny_model(tmp_path / "odd-pre.gguf", arch="qwen2", pre="no-such-pre")
    prompt = [5, 6, 7, 8, 9]
    loaded = load_model(path, mode="exact")
    want = generate(LocalEngine(loaded.model, n_ctx=N_CTX), prompt, max_tokens=6, sampler=GREEDY).token_ids
    for local_ring in start_ring(2, path, ring_logs / "odd-pre"):
        ring = Ring.connect(local_ring.addresses, rounds=1)
        try:
            got = ring_tokens(ring, prompt, 6)
        finally:
            ring.close()
        assert got == want
