"""`prima run --chat`: the model's template, a --chat-template file, and a clear warning (once)
when the model ships no template, on a tiny model written by tests/tiny_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.model.gguf_file import GGUFFile
from prima.model.tokenizer import Tokenizer
from tests.tiny_models import CHATML_TEMPLATE, write_tiny_model


def _prompt_ids(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> tuple[list[int], str]:
    argv = ["run", "-m", str(path), "--local", "--exact", "-p", "Hi there", "-n", "2", "--json", *extra]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out)["prompt_token_ids"], captured.err


def _chatml_ids(path: Path) -> list[int]:
    with GGUFFile(path) as gguf:
        tok = Tokenizer.from_gguf(gguf.metadata)
    return tok.encode("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", parse_special=True)


def test_chat_without_model_template_warns_once_and_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_model(tmp_path / "bare.gguf", chat_template=None)
    _, err = _prompt_ids(capsys, path, "--chat")
    assert err.count("ships no chat template") == 1
    assert "--chat-template FILE" in err


def test_chat_template_file_replaces_the_fallback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_model(tmp_path / "bare.gguf", chat_template=None)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE, encoding="utf-8")
    ids, err = _prompt_ids(capsys, path, "--chat", "--chat-template", str(template))
    assert ids == _chatml_ids(path)
    assert "chat template" not in err


def test_model_template_is_used_without_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_model(tmp_path / "chatml.gguf")
    ids, err = _prompt_ids(capsys, path, "--chat")
    assert ids == _chatml_ids(path)
    assert "chat template" not in err


def test_bad_chat_template_file_fails_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    argv = [
        "run",
        "-m",
        str(tmp_path / "absent.gguf"),
        "--local",
        "-p",
        "x",
        "--chat",
        "--chat-template",
        str(broken),
    ]
    assert main(argv) == 1
    assert "not a valid Jinja template" in capsys.readouterr().err  # not "no such model file"


def test_chat_template_without_chat_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_model(tmp_path / "chatml.gguf")
    assert main(["run", "-m", str(path), "--local", "-p", "x", "--chat-template", str(path)]) == 1
    assert "only applies with --chat" in capsys.readouterr().err
