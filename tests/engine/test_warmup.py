"""The kernels compile once, before anything runs them: a complete cache is used as it is, and
the README's quick start succeeds on its first run with an empty kernel cache, saying so."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from prima import paths
from prima.engine import warmup
from prima.kernels import compile_cache
from tests.conftest import tiny_model_path
from tests.tiny_models import write_tiny_model


def readme_quick_start() -> list[str]:
    """The arguments of the README's quick-start `prima run` line, as a user types them."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    line = next(x for x in readme.splitlines() if x.startswith("prima run --local-ring"))
    return shlex.split(line)[1:]


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


def test_the_compile_reports_each_step_from_the_child() -> None:
    child = "print('progress 0 2 forward pass'); print('noise'); print('progress 2 2 done')"
    steps: list[tuple[int, int, str]] = []
    code, err = warmup._run_child([sys.executable, "-c", child], 60.0, lambda *s: steps.append(s))
    assert (code, err) == (0, "")
    assert steps == [(0, 2, "forward pass"), (2, 2, "done")]


def test_a_compile_past_its_timeout_is_killed() -> None:
    code, _ = warmup._run_child([sys.executable, "-c", "import time; time.sleep(60)"], 0.2, None)
    assert code is None


def test_exercise_names_every_step_in_order() -> None:
    steps: list[tuple[int, int, str]] = []
    warmup.exercise(tiny_model_path("tiny-qwen2"), lambda *s: steps.append(s))
    total = steps[0][1]
    assert [s[0] for s in steps] == list(range(total + 1))
    assert {s[1] for s in steps} == {total}
    assert [s[2] for s in steps][:2] == ["forward pass (q8)", "forward pass (exact)"]
    assert "kernel probe F32" in [s[2] for s in steps]
    assert steps[-1][2] == "done"


@pytest.mark.slow
def test_quick_start_works_on_an_empty_kernel_cache(smollm2_path: Path, tmp_path: Path) -> None:
    """The README's first command, with nothing compiled yet and nothing profiled, then again.
    After the compile, nothing else compiles: not the daemons' profiles, not Halda's search in
    the coordinator, not the first (short) prompt."""
    cache = tmp_path / "prima"
    cache.mkdir()
    (cache / "models").symlink_to(smollm2_path.parent)  # the model, but no profiles
    numba_cache = tmp_path / "numba"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache), paths.CACHE_ENV: str(cache)}
    cmd = [sys.executable, "-m", "prima.cli.main", *readme_quick_start()]
    runs = [
        subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Paris" in r.stdout
        plan = next(x for x in r.stderr.splitlines() if x.startswith("prima: plan:"))
        assert all(f"node{i} [" in plan for i in range(3)), plan  # the model is split over all three
    assert "compiling kernels" in runs[0].stderr
    assert "compiling kernels" not in runs[1].stderr
    stamps = list(numba_cache.glob("complete-*"))
    assert len(stamps) == 1
    compiled_after = [
        f.name for f in numba_cache.rglob("*.nbc") if f.stat().st_mtime_ns > stamps[0].stat().st_mtime_ns
    ]
    assert compiled_after == [], "compiled after the warm-up: " + ", ".join(sorted(compiled_after))


def test_the_cache_records_the_formats_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert compile_cache.compiled_formats() is None
    compile_cache.mark_complete({"F32", "Q8_0"})
    compile_cache.mark_complete({"Q4_0"})
    assert compile_cache.compiled_formats() == {"F32", "Q4_0", "Q8_0"}
    assert compile_cache.is_complete({"Q8_0", "Q4_0"})
    assert not compile_cache.is_complete({"Q4_K"})


def test_a_model_of_a_compiled_format_starts_no_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    model = write_tiny_model(tmp_path / "q8_0.gguf", qtype=GGMLQuantizationType.Q8_0)
    assert warmup.model_formats(model) == {"F32", "Q8_0"}  # the norms stay float
    compile_cache.mark_complete({"F32", "Q8_0", "Q4_0"})
    monkeypatch.setattr(warmup, "_run_child", None)  # a compile would fail
    assert warmup.ensure_compiled(model) is False


def _stamp(numba_cache: Path) -> Path:
    (stamp,) = numba_cache.glob("complete-*")
    return stamp


def _compiled_since(numba_cache: Path, mtime_ns: int) -> list[str]:
    return sorted(f.name for f in numba_cache.rglob("*.nbc") if f.stat().st_mtime_ns > mtime_ns)


@pytest.mark.slow
def test_a_model_of_a_new_format_compiles_before_it_runs(tmp_path: Path) -> None:
    """Warmed up with a Q8_0 model, then `prima run --local` on a Q4_0 one: its kernels compile
    before the model runs (the run says so), and none compiles while it generates."""
    q8 = write_tiny_model(tmp_path / "q8_0.gguf", qtype=GGMLQuantizationType.Q8_0)
    q4 = write_tiny_model(tmp_path / "q4_0.gguf", qtype=GGMLQuantizationType.Q4_0, seed=1)
    numba_cache = tmp_path / "numba"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache)}
    prima = [sys.executable, "-m", "prima.cli.main"]

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*prima, *argv], capture_output=True, text=True, env=env, timeout=1200, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run("warmup", "-m", str(q8))
    assert _stamp(numba_cache).read_text().split() == ["F32", "Q8_0"]
    warmed_ns = _stamp(numba_cache).stat().st_mtime_ns
    done = run("run", "--local", "-m", str(q4), "-p", "The capital of France is", "-n", "4", "--json")
    assert "compiling kernels for Q4_0, once" in done.stderr
    assert _stamp(numba_cache).read_text().split() == ["F32", "Q4_0", "Q8_0"]
    assert _stamp(numba_cache).stat().st_mtime_ns > warmed_ns
    assert _compiled_since(numba_cache, _stamp(numba_cache).stat().st_mtime_ns) == [], (
        "compiled while generating"
    )
    again = run("run", "--local", "-m", str(q4), "-p", "The capital of France is", "-n", "4", "--json")
    assert "compiling kernels" not in again.stderr


def test_every_message_and_doc_states_one_compile_time() -> None:
    """The first compile's duration reads the same in the README, the docs and the CLI's lines
    (it once said 1-2 minutes in some places and 1-4 in others, while 103 s and 226 s were seen)."""
    root = Path(__file__).resolve().parents[2]
    files = [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "prima").rglob("*.py")),
    ]
    stated = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"(\d+)\s*[-–]\s*(\d+)\s*min", text):
            if "compil" in text[max(0, m.start() - 200) : m.start()].lower():
                stated.append((path.relative_to(root).as_posix(), m.group(0)))
    assert stated, "no compile time stated anywhere"
    assert {what for _, what in stated} == {"1-4 min"}, stated
    assert compile_cache.COMPILE_TIME.startswith("1-4 min")
