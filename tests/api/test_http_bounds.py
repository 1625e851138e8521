"""The HTTP API against hostile or broken clients: every malformed request, bound and missing key
gets a 4xx with an OpenAI-style error body, and the server keeps serving.

The server runs on 127.0.0.1:0 over a tiny model opened without compute and a generator that
answers one fixed token, so these tests need no downloaded model and no kernels. Every loop
that sends requests is bounded in count, and every socket has a timeout."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prima.api.server import ApiServer, HttpLimits
from prima.api.service import CompletionService
from prima.cli.cmd_serve import open_access_warning
from prima.engine.generate import GenerateRequest, GenerationDone, TokenEvent
from prima.model.files import ModelFiles, open_model
from tests.tiny_models import write_tiny_model

MODEL_ID = "tiny"
KEY = "s3cret-key"
TIMEOUT_S = 30.0  # a safety bound on every socket, never an expectation about speed
LIMITS = HttpLimits(max_body_bytes=64 << 10, body_timeout_s=0.5, idle_timeout_s=5.0, max_connections=4)
CHAT = [{"role": "user", "content": "hi"}]


class OneTokenGenerator:
    """Answers every request with token 65 ("A" in the tiny vocabulary's byte table), then stops."""

    n_ctx = 128

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        del request
        yield 65
        yield GenerationDone("length", prompt_ms=0.0, generate_ms=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return open_model(path, layers=range(0))


def _serve(tiny: ModelFiles, api_key: str | None) -> Iterator[ApiServer]:
    service = CompletionService(tiny, OneTokenGenerator(), MODEL_ID, n_ctx=128)
    srv = ApiServer(("127.0.0.1", 0), service, limits=LIMITS, api_key=api_key)
    thread = srv.serve_in_background()
    yield srv
    srv.stop()
    thread.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def server(tiny: ModelFiles) -> Iterator[ApiServer]:
    yield from _serve(tiny, None)


@pytest.fixture(scope="module")
def keyed(tiny: ModelFiles) -> Iterator[ApiServer]:
    yield from _serve(tiny, KEY)


def _request(
    srv: ApiServer,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, http.client.HTTPResponse]:
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(str(host), port, timeout=TIMEOUT_S)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        ctype = resp.getheader("Content-Type") or ""
        return resp.status, json.loads(payload) if "json" in ctype else payload, resp
    finally:
        conn.close()


def _raw_socket(srv: ApiServer) -> socket.socket:
    host, port = srv.server_address[:2]
    return socket.create_connection((str(host), port), timeout=TIMEOUT_S)


def _read_status(sock: socket.socket) -> tuple[int, bytes]:
    """The status code and the rest of a response read until the server closes (bounded)."""
    data = b""
    for _ in range(1000):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def _assert_error(status: int, reply: Any, want: int, words: str) -> None:
    assert status == want, reply
    assert words in reply["error"]["message"]
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 1, **fields}


def test_a_normal_request_is_answered(server: ApiServer) -> None:
    status, reply, _ = _request(server, "POST", "/v1/chat/completions", _chat(model=MODEL_ID))
    assert status == 200, reply
    assert reply["model"] == MODEL_ID


# --- the body and its JSON ---------------------------------------------------------------------------


DEEP = b"[" * 20_000 + b"]" * 20_000
NESTED = json.dumps(_chat(x=json.loads("[" * 40 + "]" * 40))).encode()
CHAT_PATH, TEXT_PATH = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    ("path", "raw", "status", "words"),
    [
        pytest.param(CHAT_PATH, DEEP, 400, "nested too deeply", id="deep-json"),
        pytest.param(CHAT_PATH, NESTED, 400, "nested more than", id="nested-json"),
        pytest.param(
            CHAT_PATH,
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "lone surrogate",
            id="surrogate-content",
        ),
        pytest.param(TEXT_PATH, b'{"prompt": "a\\udfffb"}', 400, "lone surrogate", id="surrogate-prompt"),
        pytest.param(
            TEXT_PATH, b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "lone surrogate", id="surrogate-stop"
        ),
        pytest.param(
            TEXT_PATH, b'{"prompt": "x", "seed": -1}', 400, "'seed' must be >= 0", id="seed-negative"
        ),
        pytest.param(TEXT_PATH, b'{"prompt": "x", "seed": 1e300}', 400, "'seed' must be <=", id="seed-huge"),
        pytest.param(
            TEXT_PATH,
            b'{"prompt": "x", "top_k": 99999999999999999999999}',
            400,
            "'top_k' must be <=",
            id="top-k-huge",
        ),
        pytest.param(
            TEXT_PATH,
            b'{"prompt": "x", "max_tokens": 1e30}',
            400,
            "'max_tokens' must be <=",
            id="max-tokens-huge",
        ),
        pytest.param(
            TEXT_PATH, b'{"prompt": "x", "temperature": 1e999}', 400, "finite", id="temperature-inf"
        ),
        pytest.param(TEXT_PATH, b'{"prompt": "x", "top_p": -1e999}', 400, "finite", id="top-p-minus-inf"),
        pytest.param(
            TEXT_PATH,
            b'{"prompt": "x", "repeat_penalty": 1e-300}',
            400,
            "'repeat_penalty' must be in",
            id="penalty-tiny",
        ),
        pytest.param(
            TEXT_PATH, b'{"prompt": "x", "model": "gpt-4"}', 404, "does not exist here", id="other-model"
        ),
        pytest.param(CHAT_PATH, json.dumps(_chat(model="")).encode(), 404, "runs 'tiny'", id="empty-model"),
        pytest.param(
            TEXT_PATH,
            b'{"prompt": "x", "n": 1' + b"0" * 5000 + b"}",
            400,
            "not valid JSON",
            id="int-5000-digits",
        ),
        pytest.param(TEXT_PATH, b"\xff\xfe", 400, "not valid JSON", id="not-utf8"),
    ],
)
def test_malformed_bodies_get_4xx(server: ApiServer, path: str, raw: bytes, status: int, words: str) -> None:
    got, reply, _ = _request(server, "POST", path, raw=raw)
    _assert_error(got, reply, status, words)
    assert _request(server, "GET", "/health")[0] == 200  # still serving


def test_a_request_naming_another_model_gets_model_not_found(server: ApiServer) -> None:
    status, reply, _ = _request(server, "POST", "/v1/chat/completions", _chat(model="gpt-4o"))
    assert status == 404
    assert reply["error"]["code"] == "model_not_found"
    assert reply["error"]["param"] == "model"


def test_a_body_over_the_limit_is_refused(server: ApiServer) -> None:
    raw = json.dumps({"prompt": "x" * LIMITS.max_body_bytes}).encode()
    got, reply, _ = _request(server, "POST", "/v1/completions", raw=raw)
    _assert_error(got, reply, 413, "limit")


def test_a_slow_body_is_cut_off_at_the_body_timeout(server: ApiServer) -> None:
    """A client that promises 100 bytes and sends 10 gets 408 once body_timeout_s has passed,
    instead of holding its thread until it gives up."""
    with _raw_socket(server) as sock:
        sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt":')
        status, data = _read_status(sock)  # the server answers, then closes
    assert status == 408
    assert b"did not arrive within" in data


def test_connections_over_the_limit_get_429_and_the_slots_come_back(server: ApiServer) -> None:
    idle = [_raw_socket(server) for _ in range(LIMITS.max_connections)]
    try:
        # Each idle connection holds a handler thread; the next one is refused. The server takes
        # its connections in order, so the last one below is accepted after all of them.
        _request(server, "GET", "/health")  # not yet over: may pass or be refused, either is fine
        with _raw_socket(server) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, data = _read_status(extra)
        assert status == 429
        assert b"too_many_connections" in data
    finally:
        for sock in idle:
            sock.close()
    for _ in range(200):  # the handlers see EOF and free their slots
        if _try_health(server) == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the server never served again after the idle connections closed")


def _try_health(srv: ApiServer) -> int:
    try:
        return _request(srv, "GET", "/health")[0]
    except (ConnectionError, http.client.HTTPException):
        return 0


# --- the API key -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}],
    ids=["none", "wrong", "not-bearer", "empty"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/cluster"), ("GET", "/metrics")],
)
def test_without_the_key_every_api_route_gets_401(
    keyed: ApiServer, method: str, path: str, headers: dict[str, str]
) -> None:
    status, reply, resp = _request(
        keyed, method, path, _chat() if method == "POST" else None, headers=headers
    )
    assert status == 401
    assert reply["error"]["code"] == "invalid_api_key"
    assert reply["error"]["type"] == "invalid_request_error"
    assert resp.getheader("WWW-Authenticate", "").startswith("Bearer")


def test_with_the_key_requests_are_served(keyed: ApiServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    status, reply, _ = _request(keyed, "POST", "/v1/chat/completions", _chat(), headers=auth)
    assert status == 200, reply
    assert _request(keyed, "GET", "/v1/models", headers=auth)[0] == 200


@pytest.mark.parametrize("path", ["/health", "/", "/static/app.js"])
def test_health_and_the_page_need_no_key(keyed: ApiServer, path: str) -> None:
    assert _request(keyed, "GET", path)[0] == 200


def test_the_page_can_send_the_key() -> None:
    root = Path(__file__).resolve().parents[2] / "prima" / "api" / "static"
    assert 'id="api-key"' in (root / "index.html").read_text()
    app = (root / "app.js").read_text()
    assert "localStorage" in app
    assert "Authorization: `Bearer ${key}`" in app


@pytest.mark.parametrize(
    ("host", "key", "warns"),
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("0.0.0.0", None, True),
        ("192.168.1.5", None, True),
        ("0.0.0.0", KEY, False),
    ],
)
def test_serving_beyond_loopback_without_a_key_warns(host: str, key: str | None, warns: bool) -> None:
    warning = open_access_warning(host, key)
    assert (warning is not None) == warns
    if warning:
        assert "PRIMA_API_KEY" in warning
