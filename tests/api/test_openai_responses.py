"""Response bodies (prima.api.openai_responses) in OpenAI's shapes, whole and streamed."""

from __future__ import annotations

from prima.api.openai_responses import (
    completion_response,
    finish_reason,
    response_id,
    stream_chunk,
    usage_chunk,
    usage_of,
)
from prima.api.openai_schema import ChatMessage, GenerationRequest, Usage
from prima.engine.generate import GenerationResult, Timings


def test_finish_reason_maps_engine_stops() -> None:
    assert finish_reason("eos") == "stop"
    assert finish_reason("stop_string") == "stop"
    assert finish_reason("length") == "length"


def test_chat_response_and_chunks_have_openai_shape() -> None:
    req = GenerationRequest(kind="chat", model=None, messages=(ChatMessage("user", "hi"),))
    ident = {"response_id": "chatcmpl-1", "created": 5, "model": "m"}
    body = completion_response(req, **ident, text="Hello", stop_reason="eos", usage=Usage(3, 2))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    first = stream_chunk(req, **ident, first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert stream_chunk(req, **ident, text="He")["choices"][0]["delta"] == {"content": "He"}
    last = stream_chunk(req, **ident, stop_reason="length")["choices"][0]
    assert last["delta"] == {}
    assert last["finish_reason"] == "length"
    assert usage_chunk(req, **ident, usage=Usage(3, 2))["choices"] == []


def test_text_response_and_chunks_have_openai_shape() -> None:
    req = GenerationRequest(kind="text", model=None, prompt="Hi")
    ident = {"response_id": "cmpl-1", "created": 5, "model": "m"}
    body = completion_response(req, **ident, text=" there", stop_reason="length", usage=Usage(1, 1))
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " there"
    assert body["choices"][0]["finish_reason"] == "length"
    chunk = stream_chunk(req, **ident, text=" t")
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == " t"


def test_response_ids_name_the_kind_and_never_repeat() -> None:
    chat = GenerationRequest(kind="chat", model=None, messages=(ChatMessage("user", "hi"),))
    text = GenerationRequest(kind="text", model=None, prompt="Hi")
    ids = {response_id(chat) for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("chatcmpl-") for i in ids)
    assert response_id(text).startswith("cmpl-")


def test_usage_counts_the_prompt_its_cached_part_and_the_completion() -> None:
    result = GenerationResult([1, 2, 3, 4], [7, 8], timings=Timings(prompt_tokens=4, cached_tokens=3))
    assert usage_of(result) == Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=3)
