"""`prima chat` in a terminal (a pseudo-terminal here): readline editing, Ctrl-C stops the reply
and the chat goes on, Ctrl-D ends it on a fresh line. With piped input: history, /reset, /exit
and the system prompt, against llama.cpp's chat prompt."""

from __future__ import annotations

import argparse
import io
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prima.cli import cmd_chat
from prima.cli.main import main
from prima.coordinator.session import Session
from prima.engine.generate import GenerateRequest, GenerationResult
from prima.kernels import compile_cache
from prima.model.gguf_file import GGUFFile
from prima.model.tokenizer import Tokenizer
from tests.conftest import load_tiny_oracle, tiny_model_path

WAIT_S = 120.0


def _as_in_a_shell() -> None:
    """Ctrl-C reaches the child as in an interactive shell, however the tests were started: a
    runner launched in the background (`cmd &`) ignores SIGINT, its children inherit that, and
    Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A child process on a pseudo-terminal; reads are bounded by a deadline."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True, preexec_fn=_as_in_a_shell
        )
        os.close(slave)
        self.seen = b""
        self.pos = 0  # where the last marker matched ended: the next search starts there

    def read_until(self, marker: bytes, timeout_s: float = WAIT_S) -> bytes:
        """Output up to and including `marker`, searched from the end of the last match (a chunk
        may already hold the next marker)."""
        deadline = time.monotonic() + timeout_s
        start = self.pos
        while marker not in self.seen[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {self.seen[-2000:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                assert chunk, f"the chat ended before {marker!r}: {self.seen[-2000:]!r}"
                self.seen += chunk
        self.pos = self.seen.index(marker, start) + len(marker)
        return self.seen[start : self.pos]

    def read_some(self, timeout_s: float = WAIT_S) -> bytes:
        """Whatever the child writes next (at least one byte)."""
        ready = select.select([self.master], [], [], timeout_s)[0]
        assert ready, f"nothing more after {self.seen[-2000:]!r}"
        chunk = os.read(self.master, 4096)
        self.seen += chunk
        self.pos = len(self.seen)
        return chunk

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> int:
        """Wait for the child, reading what it still writes (bounded, like every read here)."""
        try:
            code = self.proc.wait(timeout=WAIT_S)
            while select.select([self.master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the child's side is closed
                    break
                if not chunk:
                    break
                self.seen += chunk
            return code
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)


@pytest.mark.slow
def test_chat_keys_behave_as_in_a_shell(smollm2_path: Path, tmp_path: Path) -> None:
    # Its own history file (PRIMA_CACHE), the kernels this session already compiled.
    env = {**os.environ, "PRIMA_CACHE": str(tmp_path), "NUMBA_CACHE_DIR": str(compile_cache.cache_dir())}
    env["TERM"] = "xterm"
    argv = [sys.executable, "-m", "prima.cli.main", "chat", "--local", "-m", str(smollm2_path), "-n", "400"]
    argv += ["--temp", "0"]
    term = Terminal(argv, env)
    try:
        term.read_until(b"> ")
        # Left arrow, then "h": readline edits "knigt" to "knight" (no escape codes reach it).
        # The story runs to -n 400 tokens (greedy), so Ctrl-C lands mid-reply even when a busy
        # machine delays the signal; a short reply (65 tokens) once ended first.
        term.write(b"Write a long story about a dragon and a knigt\x1b[Dh\r")
        term.read_until(b"\n")  # the line as entered
        term.read_some()  # the reply has started: interrupt it at once, long before its end
        term.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        term.read_until(b"[stopped]")
        term.read_until(b"> ")  # the chat goes on
        term.write(b"\x04")  # Ctrl-D
        assert term.close() == 0
        assert term.seen.rsplit(b"> ", 1)[1].startswith(b"\r\n")  # the shell's prompt starts a new line
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    history = (tmp_path / "chat_history").read_text()
    assert "Write a long story about a dragon and a knight" in history
    assert "\x1b" not in history


# Piped input (not a terminal), in-process on the tiny qwen2 oracle model: fast by default.
@pytest.fixture
def tiny_chat(monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Any], list[list[int]]]:
    """tiny-qwen2, the oracle's chat prompt, and the prompt ids of every turn the chat generates
    (their results go to `tiny_chat_results`)."""
    prompt = next(p for p in load_tiny_oracle("tiny-qwen2")["prompts"] if p["chat"])
    turns: list[list[int]] = []
    results = _RESULTS
    results.clear()
    real_open = cmd_chat.open_session

    def open_session(args: argparse.Namespace) -> Session:
        session = real_open(args)
        generate = session.generate

        def recorded(request: GenerateRequest, **kwargs: Any) -> GenerationResult:
            turns.append(list(request.prompt_ids))
            results.append(generate(request, **kwargs))
            return results[-1]

        session.generate = recorded  # type: ignore[method-assign]
        return session

    monkeypatch.setattr(cmd_chat, "open_session", open_session)
    return tiny_model_path("tiny-qwen2"), prompt, turns


_RESULTS: list[GenerationResult] = []  # each turn's result in the last tiny_chat


def _chat(model: Path, stdin: str, monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return main(
        ["chat", "--local", "--exact", "-m", str(model), "--temp", "0", "-n", "3", "--ctx", "256", *argv]
    )


def test_piped_chat_keeps_history_until_reset_and_stops_at_exit(
    tiny_chat: tuple[Path, dict[str, Any], list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, prompt, turns = tiny_chat
    text = prompt["text"]
    assert _chat(model, f"{text}\n\n{text}\n/reset\n{text}\n/exit\n{text}\n", monkeypatch) == 0
    first, second, third = turns  # the blank line and what follows /exit are not turns
    # A fresh conversation is llama.cpp's chat prompt; the next turn carries it as history.
    assert first == prompt["prompt_token_ids"]
    assert len(second) > len(first)
    assert second[: len(first)] == first
    assert third == first  # /reset forgot the history
    replies = capsys.readouterr().out.split("\n")
    assert replies[3:] == [""]
    assert replies[0] == replies[2]
    assert replies[0]
    assert prompt["f32"]["greedy_text"].startswith(replies[0])  # llama.cpp's greedy reply


def test_system_prompt_survives_reset_and_end_of_input_ends_the_chat(
    tiny_chat: tuple[Path, dict[str, Any], list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, _, turns = tiny_chat
    assert _chat(model, "Hi\n/reset\nHi", monkeypatch, "-s", "Be brief.") == 0
    first, second = turns
    assert second == first
    with GGUFFile(model) as gguf:
        rendered = Tokenizer.from_gguf(gguf.metadata).decode(first, special=True)
    # The given system prompt replaces the template's default one.
    assert "<|im_start|>system\nBe brief.<|im_end|>" in rendered
    assert "SmolLM" not in rendered
    assert len(capsys.readouterr().out.split("\n")) == 3  # two replies


def test_each_turn_computes_only_what_the_last_did_not_leave(
    tiny_chat: tuple[Path, dict[str, Any], list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat runs on the pool the CLI builds (--local), whose engine keeps its KV cache
    between turns: a turn's prompt holds the last turn's prompt and reply, and only the rest
    is computed."""
    model, _, turns = tiny_chat
    lines = ["Hello there", "Tell me more", "And then?", "/reset", "Hello there"]
    assert _chat(model, "\n".join(lines) + "\n", monkeypatch, "-n", "6") == 0
    assert len(turns) == len(_RESULTS) == 4
    for n in (1, 2):
        cached = _RESULTS[n].timings.cached_tokens
        assert len(turns[n - 1]) <= cached < len(turns[n])
    # After /reset the prompt is turn 0's again, a prefix of what the cache holds: it is cut
    # back to it, and only the last token runs again (for its logits).
    assert turns[3] == turns[0]
    assert _RESULTS[3].timings.cached_tokens == len(turns[0]) - 1


@pytest.mark.slow  # two primad processes
def test_a_chat_on_a_local_ring_sends_only_each_turns_new_tokens(
    tiny_chat: tuple[Path, dict[str, Any], list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prima chat --local-ring 2`: the daemons it starts keep the chat's ring session open
    between turns (primad --keep-sessions), so turn 2 holds turn 1's prompt and reply."""
    model, _, turns = tiny_chat
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nTell me more\n"))
    argv = [
        "chat",
        "--local-ring",
        "2",
        "--exact",
        "-m",
        str(model),
        "--temp",
        "0",
        "-n",
        "6",
        "--ctx",
        "256",
    ]
    assert main(argv) == 0
    assert len(turns) == len(_RESULTS) == 2
    assert _RESULTS[0].timings.cached_tokens == 0
    assert len(turns[0]) <= _RESULTS[1].timings.cached_tokens < len(turns[1])
