"""qwen2 and qwen3 on one device against llama.cpp: the two tiny random-weight models of
tests/tiny_qwen.py (q/k/v biases, per-head QK norms, the `qwen2` pre-tokenizer, a chat template),
with llama.cpp's outputs for them computed by llama-cpp-python as the tests run.

Their weights are F32, so both of prima's modes use exactly llama.cpp's weights: `exact` must
match llama.cpp's `f32` run (float32 KV cache) to 1e-3, and the default `q8` (which quantizes
activations only against quantized weights, and keeps the KV cache in halves) its `quant` run
(F16 KV cache) to 1e-2, each with the greedy ids exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import numpy as np
import pytest

from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.prompt import chat_prompt_ids, prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model
from tests.conftest import load_tiny_oracle, tiny_model_path
from tests.llama_reference import GGML_TYPE_F16, GGML_TYPE_F32, LlamaF32
from tests.tiny_qwen import PROMPTS, TINY_TAGS, TOKENIZE_TEXTS

F32_TOLERANCE = 1e-3
# q8 mode keeps the KV cache in halves and rounds queries and softmax weights to halves before
# they meet it, as llama.cpp does. A value within float32 noise of a boundary of the half grid
# (the noise of summing in another order: one token at a time here, a batch there) lands on the
# neighbouring half, 2^-11 away: measured up to ~6e-3 on these logits of magnitude ~10.
F16_KV_TOLERANCE = 1e-2
MODES = ("exact", "q8")


@cache
def _load(tag: str, mode: str) -> LoadedModel:
    return load_model(tiny_model_path(tag), mode=mode)


def _prompt(tag: str, name: str) -> dict[str, Any]:
    return next(p for p in load_tiny_oracle(tag)["prompts"] if p["name"] == name)


TOKENIZE_CASES = [(tag, i) for tag in TINY_TAGS for i in range(len(TOKENIZE_TEXTS))]
PROMPT_CASES = [(tag, p.name) for tag in TINY_TAGS for p in PROMPTS]


def last_logits(loaded: LoadedModel, ids: list[int]) -> np.ndarray:
    """The last prompt token's logits. In q8 mode one token per step, so every matmul takes the
    decode path (where q8 differs from exact); in exact mode one batched prefill."""
    model = loaded.model
    if model.backend.mode != "q8":
        return LocalEngine(model, n_ctx=512).forward(ids)
    n = model.config.n_layers
    kv = model.new_cache(512)
    for pos, t in enumerate(ids):
        h = model.forward_layers(model.embed(np.array([t])), np.array([pos]), 0, n, kv)
    return model.output_logits(h[-1:])[0]


def assert_close_to_llama_cpp(
    logits: np.ndarray, same: np.ndarray, quant: np.ndarray | None = None, tolerance: float = F32_TOLERANCE
) -> None:
    """Within `tolerance` of `same`, llama.cpp's run with this engine's arithmetic; close to
    llama.cpp's quantized run."""
    assert np.abs(logits - same).max() <= tolerance
    if quant is not None:
        assert int(np.argmax(logits)) == int(np.argmax(quant))
        cosine = float(logits @ quant / (np.linalg.norm(logits) * np.linalg.norm(quant)))
        assert cosine >= 0.998


@pytest.mark.parametrize(("tag", "index"), TOKENIZE_CASES)
def test_tiny_encode_matches_llama_cpp(tag: str, index: int) -> None:
    case = load_tiny_oracle(tag)["tokenize"][index]
    tok = _load(tag, "exact").tokenizer
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["text"]


@pytest.mark.parametrize(("tag", "name"), PROMPT_CASES)
def test_tiny_prompt_tokens_match_llama_cpp(tag: str, name: str) -> None:
    """Prompt text -> ids as `prima run` builds them; chat prompts through the GGUF's template."""
    prompt = _prompt(tag, name)
    loaded = _load(tag, "exact")
    tok = loaded.tokenizer
    if prompt["chat"]:
        messages = [{"role": "user", "content": prompt["text"]}]
        assert chat_prompt_ids(loaded.gguf.metadata, tok, messages) == prompt["prompt_token_ids"]
    assert prompt_ids(tok, prompt["rendered"]) == prompt["prompt_token_ids"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("tag", "name"), PROMPT_CASES)
def test_tiny_logits_match_llama_cpp(tag: str, name: str, mode: str) -> None:
    prompt = _prompt(tag, name)
    loaded = _load(tag, mode)
    assert loaded.model.backend.mode == mode
    logits = last_logits(loaded, prompt["prompt_token_ids"])
    # Both of llama.cpp's runs are on the same F32 weights; they differ in the KV cache, float32
    # (`f32`, as exact mode keeps it) or halves (`quant`, as q8 mode keeps it).
    run = "f32" if mode == "exact" else "quant"
    assert_close_to_llama_cpp(
        logits,
        prompt[run]["logits"],
        prompt["quant"]["logits"],
        F32_TOLERANCE if mode == "exact" else F16_KV_TOLERANCE,
    )
    assert list(np.argsort(-logits)[:5]) == prompt[run]["top5_ids"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("tag", "name"), PROMPT_CASES)
def test_tiny_greedy_matches_llama_cpp(tag: str, name: str, mode: str) -> None:
    prompt = _prompt(tag, name)
    loaded = _load(tag, mode)
    expected = prompt["f32"]["greedy_token_ids"]
    result = generate(
        LocalEngine(loaded.model, n_ctx=512),
        prompt["prompt_token_ids"],
        max_tokens=len(expected),
        sampler=SamplerConfig(),
        stop_ids=sorted(loaded.tokenizer.stop_ids),
    )
    assert result.token_ids == expected


# Held out: prompts that are not in the oracle, with llama.cpp's reference computed while the test
# runs (llama-cpp-python on the same F32 file, its KV cache as the mode keeps it; skips without it).
HELD_OUT_PROMPTS = (
    "Once upon a time, in 1999, there were 3 bears.",
    "  indented\n\n\tcode  {x: [1, 2, 3]} // 🙂 done",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "日本語とEnglishの混ざった文章です。数字は12345。",
)


@pytest.fixture(scope="module")
def llama_f32() -> Iterator[Callable[[str, str], LlamaF32]]:
    """`llama_f32(tag, mode)`: the tiny model opened once in llama.cpp with the KV cache of prima's
    `mode` (float32 for exact, halves for q8), closed after the module."""
    opened: dict[tuple[str, str], LlamaF32] = {}

    def get(tag: str, mode: str) -> LlamaF32:
        if (tag, mode) not in opened:
            kv_type = GGML_TYPE_F32 if mode == "exact" else GGML_TYPE_F16
            opened[tag, mode] = LlamaF32(tiny_model_path(tag), kv_type=kv_type)
        return opened[tag, mode]

    yield get
    for llm in opened.values():
        llm.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", HELD_OUT_PROMPTS, ids=range(len(HELD_OUT_PROMPTS)))
@pytest.mark.parametrize("tag", TINY_TAGS)
def test_tiny_held_out_prompts_match_llama_cpp(
    llama_f32: Callable[[str, str], LlamaF32], tag: str, text: str, mode: str
) -> None:
    loaded = _load(tag, mode)
    tok = loaded.tokenizer
    reference = llama_f32(tag, mode)
    ids = prompt_ids(tok, text)
    assert ids == reference.tokenize_prompt(text, add_bos=tok.add_bos_default)
    stops = sorted(tok.stop_ids)
    want_logits, want_greedy = reference.last_logits_and_greedy(ids, 12, stops)
    tolerance = F32_TOLERANCE if mode == "exact" else F16_KV_TOLERANCE
    assert_close_to_llama_cpp(last_logits(loaded, ids), want_logits, tolerance=tolerance)
    result = generate(
        LocalEngine(loaded.model, n_ctx=512), ids, max_tokens=12, sampler=SamplerConfig(), stop_ids=stops
    )
    assert result.token_ids == want_greedy
