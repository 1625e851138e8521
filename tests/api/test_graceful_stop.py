"""SIGTERM to a real `prima serve --local` mid-stream: new requests get 503 while the stream
finishes (or, past --shutdown-timeout, ends with an error event), the stream always ends with
`[DONE]`, and the process exits 0 saying how its requests ended."""

from __future__ import annotations

import http.client
import json
import queue
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import lines_until, popen_with_stderr_lines

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 900.0  # kernels compile on a first run; a bound for a loaded CI machine
IO_TIMEOUT_S = 120.0  # one read of the stream or one answer, on a busy machine
EXIT_TIMEOUT_S = 120.0  # the drain's deadline plus the wind-up, with room to spare
MANY_TOKENS = 2000  # far more than a stream makes before a short deadline


def _start(
    model: Path, shutdown_timeout: float
) -> tuple[subprocess.Popen[str], queue.Queue[str | None], str]:
    cmd = [sys.executable, "-m", "prima.cli.main", "serve", "--local", "-m", str(model), "--port", "0"]
    cmd += ["-t", "1", "-c", "4096", "--shutdown-timeout", f"{shutdown_timeout:g}"]
    proc, lines = popen_with_stderr_lines(cmd)
    seen = lines_until(lines, proc, r"at (http://\S+)/v1", START_TIMEOUT_S)
    found = re.search(r"at (http://\S+)/v1", seen[-1])
    assert found is not None
    return proc, lines, found.group(1)


@pytest.fixture
def stopped_at_the_end() -> Iterator[list[subprocess.Popen[str]]]:
    """Servers a test starts, killed if the test leaves one running."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(EXIT_TIMEOUT_S)


def _connect(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=IO_TIMEOUT_S)


def _open_stream(url: str, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = _connect(url)
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def _events(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of a Server-Sent Events stream, until it ends."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = _connect(url)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _sigterm_after_some_chunks(
    proc: subprocess.Popen[str], lines: queue.Queue[str | None], events: Iterator[str]
) -> list[str]:
    got = [next(events) for _ in range(3)]
    proc.send_signal(signal.SIGTERM)
    lines_until(lines, proc, r"prima serve: SIGTERM: stopping: 1 request", IO_TIMEOUT_S)
    return got


def test_sigterm_mid_stream_refuses_new_work_and_ends_the_stream(
    smollm2_path: Path, stopped_at_the_end: list[subprocess.Popen[str]]
) -> None:
    proc, lines, url = _start(smollm2_path, shutdown_timeout=60)
    stopped_at_the_end.append(proc)
    conn, resp = _open_stream(url, max_tokens=400)
    try:
        events = _events(resp)
        got = _sigterm_after_some_chunks(proc, lines, events)
        # During the drain: new work gets a 503 saying why, and /health says so too.
        status, body = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert status == 503
        assert body["error"]["code"] == "server_shutting_down"
        assert "shutting down" in body["error"]["message"]
        health = _connect(url)
        health.request("GET", "/health")
        answer = health.getresponse()
        assert (answer.status, json.loads(answer.read())["status"]) == (503, "stopping")
        health.close()
        got += list(events)
    finally:
        conn.close()
    assert got[-1] == "[DONE]"
    last = json.loads(got[-2])
    # Finished within the deadline, or (on a very slow machine) ended with the error event.
    assert last.get("choices", [{}])[0].get("finish_reason") == "length" or (
        last["error"]["code"] == "server_shutting_down"
    )
    assert proc.wait(EXIT_TIMEOUT_S) == 0
    tail = "".join(lines_until(lines, proc, r"prima serve: stopped:", IO_TIMEOUT_S))
    assert re.search(r"stopped: [01] request\(s\) finished, [01] cut", tail)


def test_short_shutdown_timeout_ends_the_stream_with_an_error_event(
    smollm2_path: Path, stopped_at_the_end: list[subprocess.Popen[str]]
) -> None:
    proc, lines, url = _start(smollm2_path, shutdown_timeout=0.2)
    stopped_at_the_end.append(proc)
    conn, resp = _open_stream(url, max_tokens=MANY_TOKENS)
    try:
        events = _events(resp)
        got = _sigterm_after_some_chunks(proc, lines, events)
        got += list(events)
    finally:
        conn.close()
    assert got[-1] == "[DONE]"
    error = json.loads(got[-2])["error"]
    assert error["code"] == "server_shutting_down"
    assert error["type"] == "server_error"
    assert "retry" in error["message"]
    assert len(got) < MANY_TOKENS
    assert proc.wait(EXIT_TIMEOUT_S) == 0
    tail = "".join(lines_until(lines, proc, r"prima serve: stopped:", IO_TIMEOUT_S))
    assert "stopped: 0 request(s) finished, 1 cut" in tail
