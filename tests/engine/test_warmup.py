"""The kernels compile once, before anything runs them: a complete cache is used as it is, and
the README's quick start succeeds on its first run with an empty kernel cache, saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prima.engine import warmup
from prima.kernels import compile_cache

QUICK_START = ["run", "--local-ring", "3", "-p", "The capital of France is", "-n", "8"]


def test_a_complete_cache_compiles_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    compile_cache.mark_complete()
    stages: list[str] = []
    # A model that does not exist: a child process would fail, so none was started.
    assert warmup.ensure_compiled(tmp_path / "missing.gguf", on_stage=stages.append) is False
    assert stages == []


def test_a_failed_compile_is_reported_and_leaves_the_cache_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    with pytest.raises(warmup.CompileError, match="compiling the kernels failed"):
        warmup.ensure_compiled(tmp_path / "missing.gguf")
    assert not compile_cache.is_complete()


@pytest.mark.slow
def test_quick_start_works_on_an_empty_kernel_cache(smollm2_path: Path, tmp_path: Path) -> None:
    """The README's first command, with nothing compiled yet, then again."""
    del smollm2_path  # fetched by the fixture; the command names the model
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cmd = [sys.executable, "-m", "prima.cli.main", *QUICK_START]
    runs = [
        subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Paris" in r.stdout
    assert "compiling kernels" in runs[0].stderr
    assert "compiling kernels" not in runs[1].stderr
