"""`prima run` reads its prompt from -p TEXT, -p - (stdin) or -f FILE, as llama-cli does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.kernels import compile_cache

PROMPT = "The capital of France is"


def _run(model: Path, *argv: str, stdin: str | None = None) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(compile_cache.cache_dir())}
    cmd = [
        sys.executable,
        "-m",
        "prima.cli.main",
        "run",
        "--local",
        "-m",
        str(model),
        "-n",
        "1",
        "--json",
        *argv,
    ]
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_prompt_from_stdin_and_from_a_file_equals_p(smollm2_path: Path, tmp_path: Path) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    given = _run(smollm2_path, "-p", PROMPT)
    assert _run(smollm2_path, "-p", "-", stdin=PROMPT)["prompt_token_ids"] == given["prompt_token_ids"]
    assert _run(smollm2_path, "-f", str(prompt_file))["prompt_token_ids"] == given["prompt_token_ids"]


def test_unreadable_prompt_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--local", "-f", str(tmp_path / "missing.txt")]) == 1
    assert "cannot read the prompt from" in capsys.readouterr().err


def test_p_and_f_together_are_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["run", "-p", "x", "-f", str(tmp_path / "x.txt")])
