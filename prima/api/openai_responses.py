"""OpenAI's response bodies as pure functions: a whole completion, the chunks of a stream, the
usage chunk, the model list and an error, from the request (prima.api.openai_schema) and what the
engine made."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from prima.api.openai_schema import GenerationRequest, Usage
from prima.engine.generate import GenerationResult


def response_id(req: GenerationRequest) -> str:
    """A fresh id in OpenAI's form for the kind of request."""
    return f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage_of(result: GenerationResult) -> Usage:
    """The token counts of a finished generation, the prompt's cached part among them."""
    return Usage(
        prompt_tokens=len(result.prompt_token_ids),
        completion_tokens=len(result.token_ids),
        cached_tokens=result.timings.cached_tokens,
    )


def finish_reason(stop_reason: str) -> str:
    """The engine's stop reason ("eos", "stop_string", "length") in OpenAI's terms."""
    return "length" if stop_reason == "length" else "stop"


def completion_response(
    req: GenerationRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    text: str,
    stop_reason: str,
    usage: Usage,
    timings: Mapping[str, float | str] | None = None,
) -> dict[str, Any]:
    """The non-streaming body: a `chat.completion` or a `text_completion`; `timings` (prompt
    and generation times, cached tokens: Timings.as_dict) goes beside `usage`, as llama-server
    puts its own."""
    if req.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason(stop_reason)
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage.as_dict(),
        **({"timings": dict(timings)} if timings is not None else {}),
    }


def stream_chunk(
    req: GenerationRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    text: str | None = None,
    first: bool = False,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    """One SSE chunk. Chat chunks carry a `delta` (the first one announces the role); text
    chunks carry `text`. The last chunk has empty content and a finish_reason."""
    reason = finish_reason(stop_reason) if stop_reason is not None else None
    if req.kind == "chat":
        delta: dict[str, str] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or ""}
        obj = "text_completion"
    choice["logprobs"] = None
    choice["finish_reason"] = reason
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    req: GenerationRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    usage: Usage,
    timings: Mapping[str, float | str] | None = None,
) -> dict[str, Any]:
    """The extra last chunk sent when `stream_options.include_usage` is set: no choices, usage
    (and `timings`, as completion_response)."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.as_dict(),
        **({"timings": dict(timings)} if timings is not None else {}),
    }


def models_response(model: str, created: int, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The one model the server (or its ring) runs; `meta` says what it can take (context, layers)."""
    entry: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "prima"}
    if meta:
        entry["meta"] = dict(meta)
    return {"object": "list", "data": [entry]}


def error_body(
    message: str, err_type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope; `type` is e.g. invalid_request_error, server_error."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
