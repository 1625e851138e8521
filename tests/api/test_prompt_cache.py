"""`prima serve --local` keeps each engine's KV cache between requests: a chat's next turn, sent
with the whole conversation as OpenAI clients (and the web page) send it, computes only what
the previous turn did not leave, and says so in `usage.prompt_tokens_details.cached_tokens`,
in `timings` and in /metrics' prima_prompt_cached_tokens."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prima.api.server import ApiServer
from prima.api.service import CompletionService, ServeDefaults
from prima.engine.local import local_generator
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow  # SmolLM2 over HTTP, three turns

N_CTX = 512
HTTP_TIMEOUT_S = 300
MAX_SSE_LINES = 1000
CACHED = "prima_prompt_cached_tokens_total"


@cache
def _smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    loaded = _smollm2()
    pool = local_generator(loaded, N_CTX, parallel=2)
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=16)
    service = CompletionService(loaded, pool, "smollm2-135m", pool.n_ctx, defaults=defaults)
    srv = ApiServer(("127.0.0.1", 0), service)
    thread = srv.serve_in_background()
    yield srv
    srv.stop()
    thread.join(HTTP_TIMEOUT_S)
    pool.close()


def _connect(srv: ApiServer) -> http.client.HTTPConnection:
    host, port = srv.server_address[:2]
    return http.client.HTTPConnection(str(host), port, timeout=HTTP_TIMEOUT_S)


def _chat(srv: ApiServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    conn = _connect(srv)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": messages}).encode())
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200, body
        return body
    finally:
        conn.close()


def _chat_stream(srv: ApiServer, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    """The streamed reply's text and its usage chunk."""
    conn = _connect(srv)
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
        resp = conn.getresponse()
        assert resp.status == 200
        events = []
        for _ in range(MAX_SSE_LINES):
            line = resp.readline().strip()
            if line == b"data: [DONE]":
                break
            if line:
                events.append(json.loads(line[len(b"data: ") :]))
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        return text, events[-1]
    finally:
        conn.close()


def _cached_total(srv: ApiServer) -> float:
    conn = _connect(srv)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == CACHED]
    assert len(samples) == 1
    return samples[0].value


def test_a_chats_next_turn_reuses_the_cache_and_reports_it(server: ApiServer) -> None:
    before = _cached_total(server)
    messages = [
        {"role": "system", "content": "You are a geography teacher. Answer in one or two sentences."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first = _chat(server, messages)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first["timings"]["cached_tokens"] == 0
    assert first["timings"]["prompt_tokens"] == first["usage"]["prompt_tokens"]

    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And of Italy?"},
    ]
    text, usage_chunk = _chat_stream(server, messages)
    assert text
    usage = usage_chunk["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # The whole first turn's prompt was held; only its reply's end and the new turn ran.
    assert first["usage"]["prompt_tokens"] <= cached < usage["prompt_tokens"]
    assert usage_chunk["timings"]["cached_tokens"] == cached

    # Another conversation with the same system prompt goes to the other engine (the pool may
    # grow), and the first conversation's cache is still there for its third turn.
    other = _chat(server, [messages[0], {"role": "user", "content": "Where is Peru?"}])
    assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Spain?"}]
    third = _chat(server, messages)
    third_cached = third["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert usage["prompt_tokens"] <= third_cached < third["usage"]["prompt_tokens"]

    assert _cached_total(server) - before == cached + third_cached
