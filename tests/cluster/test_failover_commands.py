"""The commands keep going when a node dies mid-reply: `prima chat` on named daemons keeps the
conversation (each reply equals the same chat on one device), `prima run --logits-out` on the
nodes left loses its head and still prints llama.cpp's greedy text and writes llama.cpp's prompt
logits, and `prima serve` hands the HTTP client one uninterrupted stream whose text equals a
failure-free completion."""

from __future__ import annotations

import http.client
import io
import json
import queue
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from prima.cli.main import main
from prima.coordinator.local_ring import LocalRing

from ..conftest import popen_with_stderr_lines
from .conftest import start_ring

pytestmark = pytest.mark.slow

TURNS = "What is the capital of France?\nAnd of Italy?\n"
KILL_AFTER_PIECES = 5
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 120.0
F32_TOLERANCE = 1e-3  # tests/forward/test_windowed_model.py's bound for SmolLM2's float32 logits


class KillingTerminal(io.StringIO):
    """A command's stdout: after `after` pieces of text have been shown, `kill` runs once."""

    def __init__(self, after: int, kill: Callable[[], None]) -> None:
        super().__init__()
        self.after = after
        self.kill: Callable[[], None] | None = kill
        self.pieces = 0

    def write(self, text: str) -> int:
        self.pieces += 1
        if self.kill is not None and self.pieces > self.after:
            self.kill()
            self.kill = None
        return super().write(text)


def _chat(monkeypatch: pytest.MonkeyPatch, out: io.StringIO, model: Path, *where: str) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO(TURNS))
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["chat", "-m", str(model), "--exact", "--temp", "0", "-n", "16", "--ctx", "512", *where]
    assert main(argv) == 0
    return out.getvalue()


@pytest.fixture
def three_nodes(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(3, smollm2_path, ring_logs / "chat")


def test_chat_then_run_carry_on_across_killed_nodes(
    three_nodes: LocalRing,
    smollm2_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    oracle: Callable[[str], dict[str, Any]],
    tmp_path: Path,
) -> None:
    alone = _chat(monkeypatch, io.StringIO(), smollm2_path, "--local")
    nodes = ",".join(three_nodes.addresses)
    terminal = KillingTerminal(KILL_AFTER_PIECES, lambda: three_nodes.kill(2))
    with caplog.at_level("WARNING", logger="prima.coordinator"):
        on_ring = _chat(monkeypatch, terminal, smollm2_path, "--nodes", nodes, "--windows", "10,10,10")
    assert terminal.kill is None  # the node was killed mid-reply
    assert any("recovered after" in r.getMessage() for r in caplog.records)
    # The new plan is told as the first one was: two nodes, windows by hand split evenly.
    replanned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("re-planned, epoch")]
    assert replanned, [r.getMessage() for r in caplog.records]
    assert "windows by hand" in replanned[0]
    assert replanned[0].count(" [") == 2
    assert on_ring == alone
    assert len(alone.strip().split("\n")) == 2  # two replies, the second after the failover

    # prima run on the two nodes left loses its head mid-generation; the last node carries on.
    case = next(p for p in oracle("smollm2-135m")["prompts"] if p["name"] == "capital")
    logits_file = tmp_path / "logits.npy"
    terminal = KillingTerminal(KILL_AFTER_PIECES, lambda: three_nodes.kill(0))
    monkeypatch.setattr(sys, "stdout", terminal)
    argv = [
        "run",
        "-m",
        str(smollm2_path),
        "--nodes",
        ",".join(three_nodes.addresses[:2]),
        "--windows",
        "15,15",
    ]
    argv += ["-p", case["text"], "-n", "16", "--temp", "0", "--ctx", "512", "--logits-out", str(logits_file)]
    assert main(argv) == 0
    assert terminal.kill is None
    printed = terminal.getvalue()
    assert printed.endswith("\n")
    assert terminal.pieces > KILL_AFTER_PIECES + 2  # text came after the kill, then the newline
    assert case["f32"]["greedy_text"].startswith(printed[:-1])  # llama.cpp's 24 greedy tokens
    want = case["f32"]["logits"]
    assert np.abs(np.load(logits_file) - want).max() <= F32_TOLERANCE


def _serve(model: Path) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    """`prima serve --local-ring 3` on 127.0.0.1:0 with its stderr lines on a queue."""
    cmd = [sys.executable, "-m", "prima.cli.main", "serve", "-m", str(model), "--local-ring", "3"]
    cmd += ["--windows", "10,10,10", "--exact", "--port", "0", "--ctx", "512", "-n", "32", "--temp", "0"]
    return popen_with_stderr_lines(cmd)


def _wait_for(lines: queue.Queue[str | None], pattern: str, seen: list[str]) -> re.Match[str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        assert line is not None, f"prima serve exited:\n{''.join(seen)[-3000:]}"
        seen.append(line)
        if found := re.search(pattern, line):
            return found
    raise AssertionError(
        f"no {pattern!r} from prima serve within {START_TIMEOUT_S:g} s:\n{''.join(seen)[-3000:]}"
    )


def _post(port: int, body: dict[str, object]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return resp


def _kill_daemon(serve: subprocess.Popen[str], name: str) -> None:
    """SIGKILL the serve process's primad named `name` (its parent reaps it, so no wait here)."""
    for child in psutil.Process(serve.pid).children():
        if name in child.cmdline():
            child.send_signal(signal.SIGKILL)
            return
    raise AssertionError(f"prima serve runs no primad named {name}")


def test_serve_streams_one_completion_across_a_killed_node(smollm2_path: Path) -> None:
    proc, lines = _serve(smollm2_path)
    seen: list[str] = []
    try:
        port = int(_wait_for(lines, r"web page at http://127\.0\.0\.1:(\d+)/", seen).group(1))
        body = {"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}
        resp = _post(port, {**body, "stream": True})
        pieces: list[str] = []
        while (line := resp.readline()) and line.strip() != b"data: [DONE]":
            if line.startswith(b"data: "):
                pieces += [c["text"] for c in json.loads(line[6:])["choices"] if c.get("text")]
                if len(pieces) == KILL_AFTER_PIECES:
                    _kill_daemon(proc, "node2")
        assert line.strip() == b"data: [DONE]"
        _wait_for(lines, r"recovered after \d+ tokens on node0 -> node1", seen)
        unbroken = json.loads(_post(port, body).read())["choices"][0]["text"]
        assert "".join(pieces) == unbroken
        assert len(pieces) > KILL_AFTER_PIECES
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
