"""Shared fixtures: the two test models (fetched through the registry if absent), llama.cpp's
outputs for them (tests/data/llama_cpp), and the two tiny Qwen models (tests/tiny_qwen.py),
written from SmolLM2's vocabulary, with llama.cpp's outputs for them computed live."""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.errors import ModelFetchError
from prima.model.registry import resolve_model
from tests.skip_policy import ALLOWED_SKIPS_ENV, allowed_patterns, skip_reason, unexpected_skips
from tests.tiny_qwen import TINY_TAGS, llama_cpp_outputs, write_tiny_qwen

# Tests send traffic only to loopback: mDNS discovery binds 127.0.0.1 (daemons inherit this).
os.environ.setdefault("PRIMA_MDNS_INTERFACES", "127.0.0.1")
# A developer's own cluster identity (~/.config/prima/cluster) never takes part in the tests:
# local rings bring throwaway credentials, and tests that need a cluster make their own.
os.environ.setdefault("PRIMA_CLUSTER_DIR", tempfile.mkdtemp(prefix="prima-test-cluster-"))

# Tests pass --threads or use numba's default; the first run of each (tiny, temporary) model
# would otherwise time decode steps for ~10 s (tests/engine/test_thread_tuning.py covers that).
os.environ.setdefault("PRIMA_THREAD_TUNING", "off")

# Set by .ci/run: the test models must be there (see models_required).
REQUIRE_MODELS_ENV = "PRIMA_REQUIRE_MODELS"
# llama.cpp's outputs for the two test models (tests/data/llama_cpp/README.md says how they were made).
ORACLE_DIR = Path(__file__).resolve().parent / "data" / "llama_cpp"
ORACLE_TAGS = ("smollm2-135m", "gemma3-270m")
# Both test models continue this text by repeating it: speculative decoding's drafts are kept.
REPEAT_TEXT = (
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday,"
)


@cache
def load_oracle(tag: str) -> dict[str, Any]:
    """The parsed `<tag>.json`, each run's `logits_file` read into `logits`, as the tiny
    models' outputs have it (cached: tests only read it)."""
    outputs = json.loads((ORACLE_DIR / f"{tag}.json").read_text(encoding="utf-8"))
    for prompt in outputs["prompts"]:
        for run in ("f32", "quant"):
            prompt[run]["logits"] = np.load(ORACLE_DIR / prompt[run].pop("logits_file"))
    return outputs


@cache
def tiny_model_path(tag: str) -> Path:
    """The GGUF of a tiny Qwen model (`tiny-qwen2`, `tiny-qwen3`), written once per test run
    from the SmolLM2 test model's vocabulary (fetched if absent, as `smollm2_path`)."""
    if tag not in TINY_TAGS:
        raise ValueError(f"no tiny model {tag!r}; there are {', '.join(TINY_TAGS)}")
    path = _tiny_dir() / f"{tag}-f32.gguf"
    arch = tag.removeprefix("tiny-")
    return write_tiny_qwen(path, arch, _model_path("smollm2-135m"), seed=TINY_TAGS.index(tag) + 2)


@cache
def _tiny_dir() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="prima-tiny-models-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


@cache
def load_tiny_oracle(tag: str) -> dict[str, Any]:
    """llama.cpp's outputs for a tiny model (tests/tiny_qwen.py's `llama_cpp_outputs`: each
    run's `logits` is an array), computed once per test run; skips without llama-cpp-python."""
    return llama_cpp_outputs(tiny_model_path(tag))


def models_required() -> bool:
    """True under CI (`PRIMA_REQUIRE_MODELS=1`, set by .ci/run): a test model that cannot be
    fetched is then a failure, not a skip that would hide the real-model tests."""
    return os.environ.get(REQUIRE_MODELS_ENV, "") not in ("", "0")


def _model_path(name: str) -> Path:
    """A test model's path, fetched through the registry if absent. Offline, a developer's run
    skips the tests that need it; CI fails them."""
    try:
        return resolve_model(name)
    except ModelFetchError as exc:
        if models_required():
            pytest.fail(f"test model {name} unavailable and ${REQUIRE_MODELS_ENV} is set: {exc}")
        pytest.skip(f"test model {name} unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model_path("smollm2-135m")


@pytest.fixture
def private_copy(smollm2_path: Path, tmp_path: Path) -> Path:
    """SmolLM2 copied where no other process maps it, so its page cache (mincore) reflects only
    this test; synced, since dirty pages cannot be dropped."""
    dst = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, dst)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return dst


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model_path("gemma3-270m")


@pytest.fixture(scope="session")
def oracle() -> Callable[[str], dict[str, Any]]:
    """`oracle(tag)` -> llama.cpp's outputs for that test model (`tokenize`, `prompts`, ...)."""
    return load_oracle


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `oracle_tokenize_case` as (tag, text, ids) and `oracle_prompt_case` as
    (tag, prompt dict) over every case in the oracle files, one test id per case."""
    if "oracle_tokenize_case" in metafunc.fixturenames:
        cases = [(t, c["text"], c["ids"]) for t in ORACLE_TAGS for c in load_oracle(t)["tokenize"]]
        ids = [f"{t}-{i}" for t in ORACLE_TAGS for i in range(len(load_oracle(t)["tokenize"]))]
        metafunc.parametrize("oracle_tokenize_case", cases, ids=ids)
    if "oracle_prompt_case" in metafunc.fixturenames:
        prompts = [(t, p) for t in ORACLE_TAGS for p in load_oracle(t)["prompts"]]
        metafunc.parametrize("oracle_prompt_case", prompts, ids=[f"{t}-{p['name']}" for t, p in prompts])


def popen_with_stderr_lines(cmd: list[str]) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    """Start `cmd` with its stderr lines on a queue (None once it closes), read by a thread so
    that the process never blocks on a full pipe: how tests follow a `prima serve` they start."""
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    return proc, lines


def lines_until(
    lines: queue.Queue[str | None], proc: subprocess.Popen[str], pattern: str, timeout_s: float
) -> list[str]:
    """The stderr lines of `proc` (from `popen_with_stderr_lines`) up to and including the first
    that matches `pattern`; fails with the lines seen if the process exits or time runs out."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            raise AssertionError(f"{proc.args[:4]} exited ({proc.poll()}):\n{''.join(seen)[-3000:]}")
        seen.append(line)
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s:g} s:\n{''.join(seen)[-3000:]}")


REPO = Path(__file__).resolve().parents[1]


def run_python(
    code: str, *args: str, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -c code args...` in a fresh interpreter (what a process imports and holds is the
    point of such tests), with this checkout on PYTHONPATH and `env` added to the environment;
    the test fails with the child's stderr if it exits non-zero."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under $PRIMA_ALLOWED_SKIPS (set by .ci/run), a skip whose reason is not listed there as
    something a machine may lack fails the run (tests/skip_policy.py)."""
    patterns = allowed_patterns()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if patterns is None or reporter is None:
        return
    reasons = [skip_reason(r.longrepr) for r in reporter.stats.get("skipped", [])]
    unexpected = unexpected_skips(reasons, patterns)
    session.config.stash[_UNEXPECTED_SKIPS] = unexpected
    if unexpected and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_UNEXPECTED_SKIPS = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    unexpected = config.stash.get(_UNEXPECTED_SKIPS, [])
    if unexpected:
        terminalreporter.section(f"skips not allowed by ${ALLOWED_SKIPS_ENV}", red=True)
        for reason in unexpected:
            terminalreporter.line(f"  {reason}")
        terminalreporter.line("a skip is for what a machine cannot do: ship or compute what the test needs")
