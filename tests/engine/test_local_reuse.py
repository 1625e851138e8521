"""A LocalEngine's KV cache outlives a request: the next request keeps the prefix it shares
with what the cache holds and computes only the rest, and its logits are still llama.cpp's
(tiny-qwen2's prompts within the backend's tolerance, exact and q8 mode; the quantized test
models in q8 mode as close as a whole-prompt prefill is); the pool sends a request to the
engine holding its prefix; a multi-turn chat in exact mode gives the greedy text it gives when
every turn starts from an empty cache."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.engine.generate import GenerateRequest, GenerationDone, LocalGenerator, TokenEvent
from prima.engine.local import LocalEngine, local_generator
from prima.engine.prompt import chat_prompt_ids
from prima.forward.loader import LoadedModel, load_model
from tests.conftest import ORACLE_TAGS, load_oracle, load_tiny_oracle, tiny_model_path

N_CTX = 128


@cache
def _load(path: Path, mode: str) -> LoadedModel:
    return load_model(path, mode=mode)


@pytest.fixture(scope="module")
def prompts() -> dict[str, dict[str, Any]]:
    """tiny-qwen2's prompts with llama.cpp's logits of their last token."""
    return {p["name"]: p for p in load_tiny_oracle("tiny-qwen2")["prompts"]}


def _run(
    generator: Any, prompt: list[int], max_tokens: int = 0, n_ctx: int = N_CTX
) -> tuple[list[int], GenerationDone]:
    """A greedy generation's tokens and its GenerationDone (with the prompt's logits)."""
    request = GenerateRequest(tuple(prompt), max_tokens, n_ctx=n_ctx, want_prompt_logits=True)
    events: list[TokenEvent] = list(generator.generate(request))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    return [int(e) for e in events[:-1]], done


def _oracle_logits(prompt: dict[str, Any], mode: str) -> np.ndarray:
    """llama.cpp's run with the KV cache the mode keeps: float32 (exact) or halves (q8)."""
    return prompt["f32" if mode == "exact" else "quant"]["logits"]


@pytest.mark.parametrize("mode", ["exact", "q8"])
def test_a_request_keeps_the_prefix_it_shares_and_computes_the_rest(
    prompts: dict[str, dict[str, Any]], mode: str
) -> None:
    loaded = _load(tiny_model_path("tiny-qwen2"), mode)
    tolerance = loaded.model.backend.logit_tolerance
    chat = prompts["chat_zh"]
    ids = chat["prompt_token_ids"]
    engine = LocalEngine(loaded.model, N_CTX)
    generator = LocalGenerator(engine)

    # The first 20 tokens, then others the next prompt does not have.
    _run(generator, ids[:20] + ids[-10:])
    assert engine.held_tokens == tuple(ids[:20] + ids[-10:])
    _, done = _run(generator, ids)
    assert done.cached_tokens == 20
    assert engine.held_tokens == tuple(ids)
    assert done.prompt_logits is not None
    assert np.abs(done.prompt_logits - _oracle_logits(chat, mode)).max() <= tolerance

    # The same prompt again: all is held, but the last token runs again for its logits.
    _, again = _run(generator, ids)
    assert again.cached_tokens == len(ids) - 1
    assert again.prompt_logits is not None
    assert np.abs(again.prompt_logits - _oracle_logits(chat, mode)).max() <= tolerance

    # A prompt that shares nothing starts from an empty cache.
    code = prompts["code"]
    _, fresh = _run(generator, code["prompt_token_ids"])
    assert fresh.cached_tokens == 0
    assert fresh.prompt_logits is not None
    assert np.abs(fresh.prompt_logits - _oracle_logits(code, mode)).max() <= tolerance


def test_generated_tokens_stay_held_for_the_next_turn(prompts: dict[str, dict[str, Any]]) -> None:
    """A generation leaves its prompt and every token it fed back (all but the last sampled)."""
    loaded = _load(tiny_model_path("tiny-qwen2"), "exact")
    ids = prompts["chat_zh"]["prompt_token_ids"]
    engine = LocalEngine(loaded.model, N_CTX)
    generator = LocalGenerator(engine)
    tokens, _ = _run(generator, ids[:30], max_tokens=6)
    assert len(tokens) == 6
    assert engine.held_tokens == tuple(ids[:30] + tokens[:-1])
    _, done = _run(generator, ids[:30] + tokens + ids[30:40])
    assert done.cached_tokens == 30 + 5


def test_the_pool_sends_a_request_to_the_engine_holding_its_prefix(
    prompts: dict[str, dict[str, Any]],
) -> None:
    loaded = _load(tiny_model_path("tiny-qwen2"), "exact")
    chat = prompts["chat_zh"]["prompt_token_ids"]
    code = prompts["code"]["prompt_token_ids"]
    pool = local_generator(loaded, N_CTX, parallel=2)

    assert _run(pool, chat[:30])[1].cached_tokens == 0
    # Sharing nothing while the pool may grow: a new engine, and the first keeps its cache.
    assert _run(pool, code[:10])[1].cached_tokens == 0
    assert _run(pool, chat[:40])[1].cached_tokens == 30
    assert _run(pool, code)[1].cached_tokens == 10
    # The pool is full: a request sharing nothing takes the engine used least recently (the
    # chat's), and the other conversation is still there.
    other = [t + 1 for t in code]
    assert _run(pool, other)[1].cached_tokens == 0
    assert _run(pool, code + [5])[1].cached_tokens == len(code)
    assert _run(pool, chat)[1].cached_tokens == 0


@pytest.mark.parametrize("tag", ORACLE_TAGS)
def test_q8_logits_after_a_kept_prefix_match_llama_cpp_quant(tag: str) -> None:
    """The quantized test models in the default mode, their 311-token prompt computed after a
    kept prefix of 200 (from a cache that held another continuation): top-1 and cosine as
    tests/forward/test_quant_mode.py holds a prefill of the whole prompt to, and no further
    from llama.cpp's logits than twice what that prefill is (measured: 0.53 and 0.90 for
    the whole prompt, 0.70 and 0.77 after the kept prefix; a cache not cut back to the
    prefix: 2.9 and 4.1)."""
    prompts = {p["name"]: p for p in load_oracle(tag)["prompts"]}
    ids = prompts["long"]["prompt_token_ids"]
    quant = prompts["long"]["quant"]["logits"]
    model = _load_named(tag).model
    whole = LocalEngine(model, 512).forward(ids)
    generator = LocalGenerator(LocalEngine(model, 512))
    _run(generator, ids[:200] + prompts["code"]["prompt_token_ids"] * 4, n_ctx=512)
    _, done = _run(generator, ids, n_ctx=512)
    assert done.cached_tokens == 200
    assert done.prompt_logits is not None
    logits = done.prompt_logits
    assert int(np.argmax(logits)) == int(np.argmax(quant))
    assert float(logits @ quant / (np.linalg.norm(logits) * np.linalg.norm(quant))) >= 0.998
    assert np.abs(logits - quant).max() <= 2 * np.abs(whole - quant).max()


@cache
def _load_named(tag: str) -> LoadedModel:
    return load_model(tag, mode="q8")


@pytest.mark.slow  # SmolLM2 in exact mode, three turns generated twice
def test_a_chat_in_exact_mode_gives_the_text_of_fresh_turns(smollm2_path: Path) -> None:
    loaded = _load(smollm2_path, "exact")
    tok = loaded.tokenizer
    stops = tuple(sorted(tok.stop_ids))
    held = LocalGenerator(LocalEngine(loaded.model, 1024))
    questions = [
        "Name three planets of the solar system.",
        "Which of them is the largest, and why?",
        "Write one sentence about its moons.",
    ]
    history: list[dict[str, str]] = [{"role": "system", "content": "You answer briefly."}]
    previous = 0  # the last turn's prompt length
    for question in questions:
        history.append({"role": "user", "content": question})
        ids = tuple(chat_prompt_ids(loaded.gguf.metadata, tok, history))
        request = GenerateRequest(ids, 40, stop_ids=stops, n_ctx=1024)
        reused = list(held.generate(request))
        fresh = list(LocalGenerator(LocalEngine(loaded.model, 1024)).generate(request))
        assert reused[:-1] == fresh[:-1]
        done = reused[-1]
        assert isinstance(done, GenerationDone)
        # Every earlier turn's prompt is held (its reply too, as far as it tokenizes the same).
        assert previous <= done.cached_tokens < len(ids)
        assert (done.cached_tokens > 0) == (previous > 0)
        previous = len(ids)
        history.append({"role": "assistant", "content": tok.decode([int(t) for t in reused[:-1]])})
