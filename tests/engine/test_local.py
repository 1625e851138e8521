"""LocalEngine, the whole model on one device: prefill in micro-batches or in pieces gives
llama.cpp's logits (tests/data/llama_cpp, the float32 run, prima's exact mode), reset starts a new
session, and a prompt the context cannot hold or an empty one is refused before any work."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.engine.local import LocalEngine
from prima.errors import ContextFullError, InputError
from prima.forward.loader import LoadedModel, load_model
from tests.conftest import load_oracle, load_tiny_oracle, tiny_model_path

# The tolerance tests/forward/test_windowed_model.py holds one pass to (measured here: ~2e-5).
F32_TOLERANCE = 1e-3


@cache
def _load(path: Path) -> LoadedModel:
    return load_model(path, mode="exact")


def _prompt(oracle: dict[str, Any], name: str) -> tuple[list[int], np.ndarray]:
    """A prompt's token ids and llama.cpp's float32 logits of its last token."""
    prompt = next(p for p in oracle["prompts"] if p["name"] == name)
    return prompt["prompt_token_ids"], prompt["f32"]["logits"]


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, list[int], np.ndarray]:
    """tiny-qwen2 (4 F32 layers) and its 49-token chat prompt: fast enough for every case."""
    ids, f32 = _prompt(load_tiny_oracle("tiny-qwen2"), "chat_zh")
    return _load(tiny_model_path("tiny-qwen2")), ids, f32


def _close(logits: np.ndarray, f32: np.ndarray) -> bool:
    return float(np.abs(logits - f32).max()) <= F32_TOLERANCE and int(np.argmax(logits)) == int(
        np.argmax(f32)
    )


@pytest.mark.parametrize("ubatch", [1, 8, 48, 512])
def test_micro_batches_give_llama_cpps_logits(
    tiny: tuple[LoadedModel, list[int], np.ndarray], ubatch: int
) -> None:
    loaded, ids, f32 = tiny
    engine = LocalEngine(loaded.model, n_ctx=128, ubatch=ubatch)
    logits = engine.forward(ids)
    assert logits.shape == (engine.vocab_size,) == (loaded.model.config.vocab_size,)
    assert _close(logits, f32)
    assert engine.n_past == len(ids)
    assert {engine.cache.length(i) for i in engine.cache.layers} == {len(ids)}


@pytest.mark.slow  # loading SmolLM2's exact-mode kernels takes seconds
def test_micro_batches_of_a_real_model_give_llama_cpps_logits(smollm2_path: Path) -> None:
    ids, f32 = _prompt(load_oracle("smollm2-135m"), "code")
    engine = LocalEngine(_load(smollm2_path).model, n_ctx=64, ubatch=5)  # 18 tokens: 4 micro-batches
    assert _close(engine.forward(ids), f32)


@pytest.mark.parametrize("cut", [1, 17, 48])
def test_prefill_in_pieces_continues_the_session(
    tiny: tuple[LoadedModel, list[int], np.ndarray], cut: int
) -> None:
    loaded, ids, f32 = tiny
    engine = LocalEngine(loaded.model, n_ctx=128, ubatch=8)
    engine.forward(ids[:cut])
    assert engine.n_past == cut
    assert _close(engine.forward(ids[cut:]), f32)
    assert engine.n_past == len(ids)


def test_reset_starts_a_new_session(tiny: tuple[LoadedModel, list[int], np.ndarray]) -> None:
    loaded, ids, f32 = tiny
    engine = LocalEngine(loaded.model, n_ctx=128)
    engine.forward(list(reversed(ids)))
    engine.reset()
    assert engine.n_past == 0
    assert {engine.cache.length(i) for i in engine.cache.layers} == {0}
    assert _close(engine.forward(ids), f32)


def test_a_full_context_is_refused_before_any_work(tiny: tuple[LoadedModel, list[int], np.ndarray]) -> None:
    loaded, ids, f32 = tiny
    engine = LocalEngine(loaded.model, n_ctx=len(ids))
    engine.forward(ids[:40])
    with pytest.raises(
        ContextFullError, match=f"{40 + 10} tokens do not fit the context of {len(ids)}.*--ctx"
    ):
        engine.forward(ids[40:] + [ids[-1]])
    # The session is as it was: its last free positions still take the rest of the prompt.
    assert engine.n_past == 40
    assert _close(engine.forward(ids[40:]), f32)
    with pytest.raises(ContextFullError):
        engine.forward(ids[:1])


def test_empty_input_is_refused(tiny: tuple[LoadedModel, list[int], np.ndarray]) -> None:
    loaded, ids, _ = tiny
    engine = LocalEngine(loaded.model, n_ctx=128)
    engine.forward(ids[:3])
    with pytest.raises(InputError, match="the token list is empty"):
        engine.forward([])
    assert engine.n_past == 3


def test_context_size_is_positive_and_at_most_the_models(
    tiny: tuple[LoadedModel, list[int], np.ndarray],
) -> None:
    model = tiny[0].model
    for bad in (0, -1):
        with pytest.raises(InputError, match="context size must be positive"):
            LocalEngine(model, n_ctx=bad)
    engine = LocalEngine(model, n_ctx=model.config.context_length * 4)
    assert engine.n_ctx == model.config.context_length
    assert engine.cache.k[0].shape[0] == model.config.context_length
