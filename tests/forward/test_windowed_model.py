"""The forward pass against llama.cpp's logits, and the window property the ring relies on."""

from __future__ import annotations

from functools import cache
from itertools import pairwise
from typing import Any

import numpy as np
import pytest

from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model
from tests.conftest import load_oracle

# Exact mode (weights dequantized exactly, float32 activations) against llama.cpp on an
# F32-dequantized copy. Gemma's GELU goes through an fp16 table in ggml (we do the same), which
# turns float32 rounding differences into fp16-ulp steps in a few activations; its logits
# therefore agree to ~1e-2 rather than ~1e-4 (greedy tokens still agree exactly).
F32_TOLERANCE = {"smollm2-135m": 1e-3, "gemma3-270m": 2e-2}


@cache
def _load(tag: str) -> LoadedModel:
    return load_model(tag, mode="exact")  # the oracle tolerances are for float32 activations


def _last_logits(loaded: LoadedModel, ids: list[int]) -> np.ndarray:
    engine = LocalEngine(loaded.model, n_ctx=512)
    return engine.forward(ids)


def _prompt_cases() -> list[Any]:
    return [
        pytest.param(tag, p, id=f"{tag}-{p['name']}")
        for tag in F32_TOLERANCE
        for p in load_oracle(tag)["prompts"]
    ]


@pytest.mark.parametrize(("tag", "prompt"), _prompt_cases())
def test_logits_match_llama_cpp(tag: str, prompt: dict[str, Any]) -> None:
    loaded = _load(tag)
    logits = _last_logits(loaded, prompt["prompt_token_ids"])
    f32 = prompt["f32"]["logits"]
    quant = prompt["quant"]["logits"]
    assert np.abs(logits - f32).max() <= F32_TOLERANCE[tag]
    assert int(np.argmax(logits)) == int(np.argmax(quant))
    cosine = float(logits @ quant / (np.linalg.norm(logits) * np.linalg.norm(quant)))
    assert cosine >= 0.998
    assert list(np.argsort(-logits)[:5]) == prompt["f32"]["top5_ids"]


@pytest.mark.parametrize(("tag", "prompt"), _prompt_cases())
def test_greedy_continuation_matches_llama_cpp(tag: str, prompt: dict[str, Any]) -> None:
    loaded = _load(tag)
    expected = prompt["f32"]["greedy_token_ids"]
    result = generate(
        LocalEngine(loaded.model, n_ctx=512),
        prompt["prompt_token_ids"],
        max_tokens=len(expected),
        sampler=SamplerConfig(),
        stop_ids=sorted(loaded.tokenizer.stop_ids),
    )
    assert result.token_ids == expected


@pytest.mark.parametrize(
    ("tag", "cuts"), [("smollm2-135m", [7, 19]), ("smollm2-135m", [1, 2, 29]), ("gemma3-270m", [5, 6, 12])]
)
def test_windows_are_bit_identical_to_one_pass(tag: str, cuts: list[int]) -> None:
    loaded = _load(tag)
    model = loaded.model
    n = model.config.n_layers
    ids = np.array(load_oracle(tag)["prompts"][0]["prompt_token_ids"])
    positions = np.arange(ids.size)

    whole = model.forward_layers(model.embed(ids), positions, 0, n, model.new_cache(64))
    h = model.embed(ids)
    bounds = [0, *cuts, n]
    for start, end in pairwise(bounds):
        # Each window keeps its own KV cache, as each node of the ring does.
        h = model.forward_layers(h, positions, start, end, model.new_cache(64, range(start, end)))
    assert np.array_equal(model.output_logits(h[-1:]), model.output_logits(whole[-1:]))


def test_decode_after_prefill_equals_one_batch() -> None:
    """Token-by-token decoding equals a batched prefill of the same tokens, to float32 noise."""
    loaded = _load("smollm2-135m")
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    batched = LocalEngine(loaded.model, n_ctx=64).forward(ids)
    stepwise = LocalEngine(loaded.model, n_ctx=64)
    for t in ids:
        last = stepwise.forward([t])
    assert np.abs(batched - last).max() < 1e-3
    assert int(np.argmax(batched)) == int(np.argmax(last))
