"""The HTTP API end to end: a real server thread on 127.0.0.1:0 over the real default model.

Greedy answers must equal `generate()` on the same prompt; streams must add up to the
non-streaming text; bad input gets a 4xx naming the problem and the server keeps serving;
concurrent clients each get their own correct answer; a client that hangs up mid-stream frees
the engine at the next token. The web page's files and the cluster view (this device) are served
too; tests/api/test_web_page.py drives the page itself in a browser."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prima.api.cluster_view import ClusterMonitor, read_local
from prima.api.server import ApiServer
from prima.api.service import CompletionService, ServeDefaults
from prima.engine.generate import GenerationResult, LocalGenerator, generate
from prima.engine.local import LocalEngine
from prima.engine.prompt import chat_prompt_ids, prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model

N_CTX = 256
HTTP_TIMEOUT_S = 300.0  # a safety bound for a loaded CI machine, not an expectation
MAX_SSE_LINES = 2000

CHAT = [{"role": "user", "content": "Say hi."}]
FRANCE = "The capital of France is"


@cache
def _smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


class CountingEngine:
    """LocalEngine that records how many forward passes each generation made (reset starts one)."""

    def __init__(self, inner: LocalEngine) -> None:
        self.inner = inner
        self.n_ctx = inner.n_ctx
        self.forwards: list[int] = []

    def reset(self) -> None:
        self.forwards.append(0)
        self.inner.reset()

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        self.forwards[-1] += 1
        return self.inner.forward(token_ids)


@pytest.fixture(scope="module")
def engine() -> CountingEngine:
    return CountingEngine(LocalEngine(_smollm2().model, N_CTX))


@pytest.fixture(scope="module")
def server(engine: CountingEngine) -> Iterator[ApiServer]:
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=12)  # greedy unless a request says otherwise
    service = CompletionService(
        _smollm2(), LocalGenerator(engine), "smollm2-135m", engine.n_ctx, defaults=defaults
    )
    monitor = ClusterMonitor("smollm2-135m", lambda: read_local(_smollm2(), None))
    srv = ApiServer(("127.0.0.1", 0), service, monitor=monitor)
    thread = srv.serve_in_background()
    yield srv
    srv.stop()
    thread.join(HTTP_TIMEOUT_S)


@cache
def _reference(kind: str, text: str, max_tokens: int, stop: tuple[str, ...] = ()) -> GenerationResult:
    """What `prima run` would produce for the same prompt, on an engine of its own."""
    m = _smollm2()
    ids = (
        chat_prompt_ids(m.gguf.metadata, m.tokenizer, [{"role": "user", "content": text}])
        if kind == "chat"
        else prompt_ids(m.tokenizer, text)
    )
    return generate(
        LocalEngine(m.model, N_CTX),
        ids,
        max_tokens=max_tokens,
        sampler=SamplerConfig(),
        stop_ids=sorted(m.tokenizer.stop_ids),
        stop_strings=stop,
        decoder=m.tokenizer.stream_decoder(),
    )


def _connect(srv: ApiServer) -> http.client.HTTPConnection:
    host, port = srv.server_address[:2]
    return http.client.HTTPConnection(str(host), port, timeout=HTTP_TIMEOUT_S)


def _request(
    srv: ApiServer, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    conn = _connect(srv)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _post(srv: ApiServer, path: str, body: Any) -> tuple[int, Any]:
    return _request(srv, "POST", path, body)


def _stream(srv: ApiServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with stream=true; the parsed `data:` events up to [DONE] (which must arrive)."""
    conn = _connect(srv)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode())
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "text/event-stream"
        events = []
        for _ in range(MAX_SSE_LINES):
            line = resp.readline()
            assert line, "the stream ended without data: [DONE]"
            if not line.strip():
                continue
            assert line.startswith(b"data: ")
            payload = line[len(b"data: ") :].strip()
            if payload == b"[DONE]":
                assert resp.read().strip() == b""  # only the blank line after [DONE]; the body ends cleanly
                return events
            events.append(json.loads(payload))
        raise AssertionError("too many SSE lines")
    finally:
        conn.close()


def _chat_text(events: Sequence[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


# --- happy paths -----------------------------------------------------------------------------------


def test_health_and_models(server: ApiServer) -> None:
    status, health = _request(server, "GET", "/health")
    assert status == 200
    assert health["status"] == "ok"
    assert health["model"] == "smollm2-135m"
    status, models = _request(server, "GET", "/v1/models")
    assert status == 200
    assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
    assert models["data"][0]["meta"] == {"context_length": N_CTX, "architecture": "llama", "n_layers": 30}


def _get_bytes(srv: ApiServer, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = _connect(srv)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_the_web_page_and_its_files_are_served_from_the_package(server: ApiServer) -> None:
    status, headers, page = _get_bytes(server, "/")
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in headers["Content-Security-Policy"]  # nothing from elsewhere
    assert b'src="/static/app.js"' in page
    assert b"://" not in page  # no address elsewhere: it works on a network with no internet
    for path, kind in (("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")):
        status, headers, body = _get_bytes(server, path)
        assert status == 200
        assert headers["Content-Type"].startswith(kind)
        assert body
        assert b"://" not in body


@pytest.mark.parametrize(
    "path", ["/static/nope.js", "/static/../server.py", "/static/%2e%2e/server.py", "/index.html", "/app.js"]
)
def test_only_the_page_files_are_served(server: ApiServer, path: str) -> None:
    status, _, body = _get_bytes(server, path)
    assert status == 404
    assert json.loads(body)["error"]["code"] == "not_found"


def test_cluster_view_shows_this_device_and_the_time_measured_per_token(server: ApiServer) -> None:
    status, _ = _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 4, "temperature": 0})
    assert status == 200
    status, view = _request(server, "GET", "/v1/cluster")
    assert status == 200
    assert view["model"] == "smollm2-135m"
    assert view["mode"] == "local"
    assert view["n_layers"] == 30
    [node] = view["nodes"]
    assert node["role"] == "local"
    assert node["answering"]
    assert node["windows"] == [[0, 30]]
    assert node["device"]["ram_total_bytes"] > 0
    res = node["residency"]
    assert 0 < res["resident_bytes"] <= res["owned_bytes"]  # mincore over the layers it just ran
    measured = view["measured"]
    assert measured["requests"] >= 1
    assert measured["ms_per_token"] > 0
    assert measured["last"]["generated_tokens"] == 4


def _metrics(srv: ApiServer) -> dict[str, float]:
    """GET /metrics, parsed with prometheus_client's own parser: sample name+labels -> value."""
    conn = _connect(srv)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/plain")
        text = resp.read().decode()
    finally:
        conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_metrics_move_during_a_generation(server: ApiServer) -> None:
    before = _metrics(server)
    status, body = _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 5, "temperature": 0})
    assert status == 200
    after = _metrics(server)
    generated = body["usage"]["completion_tokens"]
    prompt = body["usage"]["prompt_tokens"]
    assert (
        after["prima_generated_tokens_total{}"] - before.get("prima_generated_tokens_total{}", 0) == generated
    )
    assert after["prima_prompt_tokens_total{}"] - before.get("prima_prompt_tokens_total{}", 0) == prompt
    assert after["prima_requests_total{outcome=ok}"] - before.get("prima_requests_total{outcome=ok}", 0) == 1
    ttft = "prima_time_to_first_token_seconds_count{}"
    assert after[ttft] - before.get(ttft, 0) == 1
    steps = "prima_token_latency_seconds_count{}"
    assert after[steps] - before.get(steps, 0) == generated - 1  # the first token comes from the prompt
    assert after["prima_queue_depth{}"] == 0


def test_greedy_chat_completion_equals_generate(server: ApiServer) -> None:
    ref = _reference("chat", CHAT[0]["content"], 12)
    status, body = _post(
        server,
        "/v1/chat/completions",
        {"model": "smollm2-135m", "messages": CHAT, "max_tokens": 12, "temperature": 0},
    )
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["model"] == "smollm2-135m"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref.text}
    assert choice["finish_reason"] == ("length" if ref.stop_reason == "length" else "stop")
    assert body["usage"] == {
        "prompt_tokens": len(ref.prompt_token_ids),
        "completion_tokens": len(ref.token_ids),
        "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids),
        "prompt_tokens_details": {"cached_tokens": 0},  # this engine keeps no cache (CountingEngine)
    }


def test_chat_stream_concatenates_to_the_non_streaming_text(server: ApiServer) -> None:
    ref = _reference("chat", CHAT[0]["content"], 12)
    events = _stream(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12})
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _chat_text(events) == ref.text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_completion_stream_with_usage_matches_generate(server: ApiServer) -> None:
    ref = _reference("text", FRANCE, 8)
    events = _stream(
        server,
        "/v1/completions",
        {"prompt": FRANCE, "max_tokens": 8, "stream_options": {"include_usage": True}},
    )
    *chunks, usage = events
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(ref.token_ids)
    assert usage["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text


def test_stop_string_cuts_the_completion(server: ApiServer) -> None:
    ref = _reference("text", FRANCE, 12, ("\n",))
    assert ref.stop_reason == "stop_string"  # llama.cpp's greedy text is " Paris.\n\nThe ..."
    status, body = _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 12, "stop": "\n"})
    assert status == 200, body
    assert body["choices"][0]["text"] == ref.text
    assert "\n" not in ref.text
    assert body["choices"][0]["finish_reason"] == "stop"
    events = _stream(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 12, "stop": ["\n"]})
    assert "".join(e["choices"][0]["text"] for e in events) == ref.text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_each_get_their_own_answer(server: ApiServer) -> None:
    prompts = [FRANCE, "One, two, three,", "def add(a, b):"]
    expected = [_reference("text", p, 4).text for p in prompts]
    answers: dict[int, Any] = {}

    def client(i: int) -> None:
        answers[i] = _post(server, "/v1/completions", {"prompt": prompts[i], "max_tokens": 4})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HTTP_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    for i, want in enumerate(expected):
        status, body = answers[i]
        assert status == 200, body
        assert body["choices"][0]["text"] == want


def test_disconnecting_stream_client_frees_the_engine(server: ApiServer, engine: CountingEngine) -> None:
    cancelled = "prima_requests_total{outcome=cancelled}"
    before = _metrics(server).get(cancelled, 0)
    body = json.dumps({"prompt": FRANCE, "max_tokens": 200, "stream": True}).encode()
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        for _ in range(MAX_SSE_LINES):  # wait for the first text chunk, then hang up
            data = sock.recv(4096)
            assert data, "the server closed before streaming"
            received += data
            if b"data: " in received:
                break
    n_before = len(engine.forwards)
    # The next request gets the engine; the abandoned generation stopped long before 200 tokens.
    status, reply = _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 4})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == _reference("text", FRANCE, 4).text
    abandoned = engine.forwards[n_before - 1]
    assert abandoned < 100
    status, health = _request(server, "GET", "/health")
    assert health["busy"] is False
    # Counted under a short label, not an exception's class name.
    assert _metrics(server)[cancelled] == before + 1


def test_a_stream_client_resetting_the_connection_prints_no_traceback(
    server: ApiServer, capfd: pytest.CaptureFixture[str]
) -> None:
    body = json.dumps({"prompt": FRANCE, "max_tokens": 200, "stream": True}).encode()
    host, port = server.server_address[:2]
    sock = socket.create_connection((str(host), port), timeout=HTTP_TIMEOUT_S)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert b"HTTP/1.1 200" in sock.recv(4096)
    # Hang up with a reset (linger 0), as a killed client does.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    status, _ = _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 2})
    assert status == 200
    assert "Traceback" not in capfd.readouterr().err


def test_connection_errors_outside_a_request_are_not_tracebacks(
    server: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        server.handle_error(None, ("127.0.0.1", 1))
    assert capsys.readouterr().err == ""


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("POST", "/v1/chat/completions", b"", 400, "empty"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "'messages' is empty"),
        ("POST", "/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages' must be a list"),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            400,
            "'max_tokens' must be an integer",
        ),
        ("POST", "/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "'temperature' must be in"),
        ("POST", "/v1/completions", json.dumps({"prompt": "word " * 400}).encode(), 400, "context holds 256"),
        ("POST", "/v1/completions", b'{"prompt": [999999]}', 400, "outside the vocabulary"),
        ("POST", "/v1/embeddings", b"{}", 400, "'input' is required"),
        ("POST", "/v1/nowhere", b"{}", 404, "no endpoint POST /v1/nowhere"),
        ("GET", "/v1/embeddings", None, 405, "use POST"),
        ("GET", "/nowhere", None, 404, "no endpoint GET /nowhere"),
        ("GET", "/v1/completions", None, 405, "use POST"),
    ],
)
def test_bad_requests_get_4xx_naming_the_problem(
    server: ApiServer, method: str, path: str, body: bytes | None, status: int, words: str
) -> None:
    got, reply = _request(server, method, path, raw=body)
    assert got == status
    assert words in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    assert _request(server, "GET", "/health")[0] == 200  # still serving


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/"])
def test_head_answers_what_get_does_without_the_body(server: ApiServer, path: str) -> None:
    conn = _connect(server)
    try:
        conn.request("GET", path)
        got = conn.getresponse()
        body = got.read()
        conn.request("HEAD", path)  # the same keep-alive connection: nothing stray follows
        head = conn.getresponse()
        assert head.read() == b""
        assert head.status == got.status == 200
        assert head.getheader("Content-Type") == got.getheader("Content-Type")
        if path != "/metrics":  # its counters move between the two requests
            assert head.getheader("Content-Length") == str(len(body))
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("OPTIONS", "/v1/completions", "POST"),
        ("TRACE", "/", "GET, HEAD"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("PUT", "/v1/chat/completions", "POST"),
    ],
)
def test_other_methods_get_405_with_allow(server: ApiServer, method: str, path: str, allow: str) -> None:
    conn = _connect(server)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        assert resp.status == 405
        assert resp.getheader("Allow") == allow
        assert f"{method} is not allowed on {path}" in reply["error"]["message"]
    finally:
        conn.close()
    assert _request(server, "GET", "/health")[0] == 200


def test_oversized_body_is_refused_before_reading(server: ApiServer) -> None:
    conn = _connect(server)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", str(server.max_body_bytes + 1))
        conn.endheaders()  # the body is never sent: the server must answer from the header alone
        resp = conn.getresponse()
        assert resp.status == 413
        assert "limit" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()
    assert _request(server, "GET", "/health")[0] == 200


def test_keep_alive_connection_serves_several_requests(server: ApiServer) -> None:
    conn = _connect(server)
    try:
        for path in ("/health", "/nowhere", "/v1/models"):
            conn.request("GET", path)
            resp = conn.getresponse()
            json.loads(resp.read())
        assert resp.status == 200
    finally:
        conn.close()
