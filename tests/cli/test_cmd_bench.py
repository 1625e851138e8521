"""`prima bench`: one worker process per engine, medians and peak memory as JSON (prima alone
here; the comparison with llama.cpp needs the optional llama-cpp-python)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import psutil
import pytest

from prima.cli.main import main
from tests.conftest import run_python
from tests.llama_reference import require_llama_cpp


@pytest.mark.slow
def test_bench_reports_prima_alone_as_json(smollm2_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "bench",
        "-m",
        str(smollm2_path),
        "--no-llama",
        "--reps",
        "2",
        "--threads",
        "2",
        "--fixed-threads",
    ]
    assert main([*args, "--prompt-tokens", "12", "--gen-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prima_mode"] == "q8"
    assert report["threads"] == 2
    assert report["busy_cores"] == 0
    assert report["prima_decode_threads"] == "fixed"
    (model,) = report["models"]
    assert model["model"] == smollm2_path.name
    (prima,) = model["results"]
    assert prima["engine"] == "prima"
    assert len(prima["runs"]) == 2
    assert all(pp > 0 and tg > 0 for pp, tg in prima["runs"])
    assert prima["ms_per_token"] == pytest.approx(1000.0 / prima["decode_tok_s"])
    # The worker maps at least the weights it read; its private memory is counted apart.
    assert prima["peak_rss_mib"] >= prima["rss_file_mib"] > 0
    assert "ratios" not in model


def test_busy_cores_spin_for_the_block_and_are_gone_after() -> None:
    from prima.cli.cmd_bench import _busy

    me = psutil.Process()
    before = {c.pid for c in me.children()}
    with _busy(2):
        spinners = [c for c in me.children() if c.pid not in before]
        assert len(spinners) == 2
        assert all(c.is_running() for c in spinners)
    assert all(not c.is_running() for c in spinners)


def test_bench_rejects_non_positive_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--no-llama", "--reps", "0"]) == 1
    assert "--reps, --prompt-tokens and --gen-tokens must be positive" in capsys.readouterr().err


def test_the_engine_worker_module_carries_nothing_of_prima() -> None:
    """Each engine's process imports the worker module first: for llama.cpp's to measure
    llama.cpp's memory, that module loads none of prima's own until the prima engine starts."""
    code = (
        "import sys, prima.cli.bench_worker; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'prima')))"
    )
    out = run_python(code, timeout=60)
    assert out.stdout.split() == ["prima", "prima.cli", "prima.cli.bench_worker"]


def test_the_llama_worker_reads_the_logits_llama_cpp_computed(smollm2_path: Path) -> None:
    """llama.cpp's decode in the bench follows its own greedy choice, past one batch of prompt:
    the logits it reads are those llama.cpp keeps for every token when asked (logits_all)."""
    llama_cpp = require_llama_cpp()
    from prima.cli.bench_worker import llama_last_logits

    ids = list(range(100, 700))  # longer than the 512-token batch
    every = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=768, logits_all=True, verbose=False)
    every.eval(ids)
    last = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=768, n_batch=512, verbose=False)
    last.eval(ids)
    np.testing.assert_allclose(llama_last_logits(last), every.scores[len(ids) - 1], atol=1e-3)
