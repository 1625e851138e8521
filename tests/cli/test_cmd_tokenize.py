"""`prima tokenize`: ids on stdout, JSON with token pieces, flags for BOS and specials."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from prima.cli.main import main


def test_tokenize_prints_ids(smollm2_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "-m", str(smollm2_path), "Hello, world!"]) == 0
    assert capsys.readouterr().out.strip() == "19556 28 905 17"


def test_tokenize_json_with_bos_and_specials(gemma3_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["tokenize", "-m", str(gemma3_path), "--json", "--bos", "--special", "<start_of_turn>user"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out == {"ids": [2, 105, 2364], "tokens": ["<bos>", "<start_of_turn>", "user"]}


def test_tokenize_without_special_splits_control_text(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tokenize", "-m", str(smollm2_path), "--json", "<|im_start|>"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ids"]) > 1
    assert "".join(out["tokens"]) == "<|im_start|>"


def test_tokenize_reads_stdin(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("a"))
    assert main(["tokenize", "-m", str(smollm2_path), "-"]) == 0
    assert capsys.readouterr().out.strip() == "81"


def test_tokenize_unknown_model_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "-m", "llama-9000", "hi"]) == 1
    assert "known models" in capsys.readouterr().err


def test_tokenize_console_script(smollm2_path: Path) -> None:
    exe = shutil.which("prima")
    if exe is None:
        pytest.skip("the prima console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [exe, "tokenize", "-m", str(smollm2_path), "--json", "The capital of France is Paris."],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(proc.stdout)["ids"] == [504, 3575, 282, 4649, 314, 7042, 30]
