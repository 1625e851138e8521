"""The generation loop on the real default model: stops, limits and bad prompts."""

from __future__ import annotations

from functools import cache

import pytest

from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.prompt import chat_prompt_ids, prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.errors import InputError
from prima.forward.loader import LoadedModel, load_model


@cache
def _smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


def test_stop_string_cuts_text_and_is_not_streamed() -> None:
    m = _smollm2()
    ids = prompt_ids(m.tokenizer, "The capital of France is")
    full = generate(
        LocalEngine(m.model, 256),
        ids,
        max_tokens=12,
        sampler=SamplerConfig(),
        decoder=m.tokenizer.stream_decoder(),
    )
    assert "\n" in full.text  # llama.cpp's greedy text: " Paris.\n\nThe ..."
    pieces: list[str] = []
    cut = generate(
        LocalEngine(m.model, 256),
        ids,
        max_tokens=12,
        sampler=SamplerConfig(),
        stop_strings=["\n"],
        decoder=m.tokenizer.stream_decoder(),
        on_text=pieces.append,
    )
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text.split("\n")[0]
    assert "".join(pieces) == cut.text


def test_eos_stops_a_chat_reply() -> None:
    m = _smollm2()
    ids = chat_prompt_ids(m.gguf.metadata, m.tokenizer, [{"role": "user", "content": "Say hi."}])
    r = generate(
        LocalEngine(m.model, 512),
        ids,
        max_tokens=64,
        sampler=SamplerConfig(),
        stop_ids=sorted(m.tokenizer.stop_ids),
        decoder=m.tokenizer.stream_decoder(),
    )
    assert r.stop_reason == "eos"
    assert r.text.strip()
    assert r.timings.generated_tokens == len(r.token_ids)


def test_empty_prompt_is_an_input_error() -> None:
    m = _smollm2()
    with pytest.raises(InputError, match="empty"):
        prompt_ids(m.tokenizer, "")
    with pytest.raises(InputError, match="empty"):
        generate(LocalEngine(m.model, 64), [], max_tokens=4, sampler=SamplerConfig())


def test_prompt_longer_than_context_is_an_input_error() -> None:
    m = _smollm2()
    ids = prompt_ids(m.tokenizer, "word " * 100)
    with pytest.raises(InputError, match="context"):
        generate(LocalEngine(m.model, 32), ids, max_tokens=4, sampler=SamplerConfig())


def test_generation_stops_at_the_context_limit() -> None:
    m = _smollm2()
    ids = prompt_ids(m.tokenizer, "one two three four five")
    r = generate(LocalEngine(m.model, len(ids) + 3), ids, max_tokens=50, sampler=SamplerConfig())
    assert r.stop_reason == "length"
    assert len(r.token_ids) == 3
