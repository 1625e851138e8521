"""`prima run` reads its prompt from -p TEXT, -p - (stdin) or -f FILE, as llama-cli does, and
reports llama.cpp's tokens, text and logits (--json, --logits-out) or streams the text."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.cli.main import main
from prima.kernels import compile_cache
from prima.model.files import open_model
from prima.scheduler.profile_schema import ModelProfile
from tests.conftest import load_tiny_oracle, run_python, tiny_model_path

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


# In-process on the tiny qwen2 model of tests/tiny_qwen.py (F32 weights, so --exact is llama.cpp's
# float32 run): fast enough to run by default.
TINY_TOLERANCE = 1e-3  # tests/model/test_tiny_qwen.py's bound for float32 logits


@pytest.fixture
def tiny_capital() -> tuple[Path, dict[str, Any]]:
    """tiny-qwen2 and the oracle's `capital` prompt (its ids, greedy f32 run and logits file)."""
    prompt = next(p for p in load_tiny_oracle("tiny-qwen2")["prompts"] if p["name"] == "capital")
    return tiny_model_path("tiny-qwen2"), prompt


def _run_tiny(model: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    assert main(["run", "--local", "--exact", "-m", str(model), "--ctx", "64", *argv]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_json_reports_llama_cpps_tokens_text_and_logits(
    tiny_capital: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompt = tiny_capital
    logits_file = tmp_path / "logits.npy"
    out, _ = _run_tiny(
        model, capsys, "-p", prompt["text"], "-n", "5", "--json", "--logits-out", str(logits_file)
    )
    doc = json.loads(out)
    assert set(doc) == {
        "model",
        "prompt_token_ids",
        "token_ids",
        "text",
        "stop_reason",
        "timings",
    }  # no plan here
    assert doc["model"] == str(model)
    assert doc["prompt_token_ids"] == prompt["prompt_token_ids"]
    assert doc["token_ids"] == prompt["f32"]["greedy_token_ids"][:5]
    assert doc["text"]
    assert prompt["f32"]["greedy_text"].startswith(doc["text"])
    assert doc["stop_reason"] == "length"
    timings = doc["timings"]
    assert (timings["prompt_tokens"], timings["generated_tokens"]) == (len(prompt["prompt_token_ids"]), 5)
    assert set(timings) >= {"prompt_ms", "prefill_tokens_per_s", "generate_ms", "decode_tokens_per_s"}
    # The last prompt token's logits, float32, as llama.cpp computed them.
    logits = np.load(logits_file)
    assert logits.dtype == np.float32
    f32 = prompt["f32"]["logits"]
    assert logits.shape == f32.shape
    assert np.abs(logits - f32).max() <= TINY_TOLERANCE


def test_zero_tokens_computes_only_the_prompt(
    tiny_capital: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompt = tiny_capital
    logits_file = tmp_path / "logits.npy"
    out, _ = _run_tiny(
        model, capsys, "-p", prompt["text"], "-n", "0", "--json", "--logits-out", str(logits_file)
    )
    doc = json.loads(out)
    assert (doc["token_ids"], doc["text"], doc["stop_reason"]) == ([], "", "length")
    assert doc["timings"]["generated_tokens"] == 0
    f32 = prompt["f32"]["logits"]
    assert np.abs(np.load(logits_file) - f32).max() <= TINY_TOLERANCE


def test_text_is_streamed_to_stdout_and_the_counts_to_stderr(
    tiny_capital: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompt = tiny_capital
    out, err = _run_tiny(model, capsys, "-p", prompt["text"], "-n", "3")
    assert out.endswith("\n")
    assert out[:-1]
    assert prompt["f32"]["greedy_text"].startswith(out[:-1])
    assert f"[{len(prompt['prompt_token_ids'])} prompt tokens at " in err
    assert ", 3 generated at " in err


def test_prompt_from_a_file_keeps_its_final_newline_and_stdin_equals_p(
    tiny_capital: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As llama-cli: -f sends the file as it is (its newline is a token, 198 in this vocab)."""
    model, prompt = tiny_capital
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt["text"] + "\n", encoding="utf-8")
    out, _ = _run_tiny(model, capsys, "-f", str(prompt_file), "-n", "0", "--json")
    assert json.loads(out)["prompt_token_ids"] == [*prompt["prompt_token_ids"], 198]
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt["text"]))
    out, _ = _run_tiny(model, capsys, "-p", "-", "-n", "0", "--json")
    assert json.loads(out)["prompt_token_ids"] == prompt["prompt_token_ids"]


@pytest.mark.parametrize("source", [["-p", ""], ["-p", "-"], ["-f", "empty.txt"]])
def test_an_empty_prompt_is_an_error(
    source: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["run", "--local", "-m", "no-such-model.gguf", *source]) == 1
    assert "the prompt is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_windows_by_hand_on_a_local_ring_give_llama_cpps_tokens(
    smollm2_path: Path, oracle: Callable[[str], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """--windows/--rounds, parsed by argparse, reach the ring as the plan: two daemons, two rounds
    of 10 + 5 layers, and the greedy tokens of llama.cpp's float32 run."""
    prompt = oracle("smollm2-135m")["prompts"][0]
    argv = [
        "run",
        "--local-ring",
        "2",
        "--windows",
        "10,5",
        "--rounds",
        "2",
        "--exact",
        "-m",
        str(smollm2_path),
    ]
    assert main([*argv, "-p", prompt["text"], "-n", "6", "--ctx", "64", "--json"]) == 0
    captured = capsys.readouterr()
    assert "prima: plan: node1 [0,5) [15,20), node0 [5,15) [20,30) (head); windows by hand" in captured.err
    doc = json.loads(captured.out)
    # Ring order puts the head (node 0) last in each round.
    assert [n["windows"] for n in doc["plan"]["nodes"]] == [[[5, 15], [20, 30]], [[0, 5], [15, 20]]]
    assert doc["token_ids"] == prompt["f32"]["greedy_token_ids"][:6]
    # Each hop of the forward pass, in ring order, with what its node measured per decode step
    # (a plan by hand has no profiles, so nothing is predicted).
    hops = doc["hops"]
    assert [h["window"] for h in hops] == [[0, 5], [5, 15], [15, 20], [20, 30]]
    assert [h["node_id"] for h in hops] == ["node1", "node0", "node1", "node0"]
    assert all(h["measured_steps"] == 5 and h["compute_ms"] > 0 for h in hops)


@pytest.mark.slow
def test_a_memory_budget_splits_the_local_ring_and_the_plan_is_told(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's quick start: --mem-budget 25M reaches each daemon, whose 25 MiB of layer
    weights hold 11 of SmolLM2's 30 layers, so Halda needs all three; stderr says how it split
    them and what it predicts."""
    argv = ["run", "--local-ring", "3", "--mem-budget", "25M", "-m", str(smollm2_path), "-p", PROMPT]
    assert main([*argv, "-n", "4", "--json"]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out)["plan"]
    model = ModelProfile.from_gguf(open_model(smollm2_path, layers=range(0)).gguf, ctx_tokens=2048)
    fits = (25 << 20) // model.layer_bytes
    assert fits == 11
    sizes = {n["node_id"]: sum(b - a for a, b in n["windows"]) for n in plan["nodes"]}
    assert sorted(sizes) == ["node0", "node1", "node2"]
    assert max(sizes.values()) <= fits
    (line,) = [x for x in captured.err.splitlines() if x.startswith("prima: plan: ")]
    for node in plan["nodes"]:
        assert f"{node['node_id']} {' '.join(f'[{a},{b})' for a, b in node['windows'])}" in line
    assert f"Halda predicts {plan['predicted_ms_per_token']:.1f} ms/token" in line
    assert "idle" not in line


def test_draft_lookup_gives_the_same_tokens_and_reports_its_counts(
    tiny_capital: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompt = tiny_capital
    out, _ = _run_tiny(model, capsys, "-p", prompt["text"], "-n", "8", "--json", "--draft", "lookup")
    doc = json.loads(out)
    assert doc["token_ids"] == prompt["f32"]["greedy_token_ids"][:8]
    timings = doc["timings"]
    assert 0 < timings["accepted_tokens"] <= timings["draft_tokens"]  # the tiny model repeats itself


def test_too_many_draft_tokens_is_an_error_naming_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--local", "-m", "no-such-model.gguf", "-p", "x", "--draft-max", "99"]) == 1
    assert "--draft-max must be between 1 and 16, got 99" in capsys.readouterr().err


def test_draft_model_gives_llama_cpps_tokens_and_reports_its_counts(
    tiny_capital: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny-qwen3 drafts for tiny-qwen2 (the same vocabulary, other random weights)."""
    model, prompt = tiny_capital
    draft = tiny_model_path("tiny-qwen3")
    out, _ = _run_tiny(model, capsys, "-p", prompt["text"], "-n", "8", "--json", "-md", str(draft))
    doc = json.loads(out)
    assert doc["token_ids"] == prompt["f32"]["greedy_token_ids"][:8]
    assert 0 < doc["timings"]["draft_tokens"]
    assert doc["timings"]["accepted_tokens"] <= doc["timings"]["draft_tokens"]
    assert doc["timings"]["draft_off"] == ""  # drafted as asked (a failover may change that)


def test_draft_flags_that_disagree_are_an_error_naming_the_fix(
    tiny_capital: tuple[Path, dict[str, Any]], gemma3_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = tiny_capital
    base = ["run", "--local", "-m", str(model), "--ctx", "64", "-p", "x", "-n", "2"]
    assert main([*base, "--draft", "lookup", "--draft-model", str(model)]) == 1
    assert "--draft-model drafts with a model, --draft lookup without one" in capsys.readouterr().err
    assert main([*base, "--draft", "model"]) == 1
    assert "give --draft-model PATH_OR_NAME" in capsys.readouterr().err
    assert main([*base, "--model-draft", str(gemma3_path)]) == 1
    err = capsys.readouterr().err
    assert "does not share the vocabulary" in err
    assert str(gemma3_path) in err
    assert str(model) in err


# Runs `prima run --local` in this interpreter, then names the ring-only packages it loaded.
RING_ONLY = """
import sys
from prima.cli.main import main

code = main(["run", "--local", "-m", sys.argv[1], "-p", "Hi", "-n", "2"])
print(sorted(m for m in ("grpc", "zeroconf", "cryptography", "prima.net.client") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.slow
def test_run_on_one_device_loads_no_ring_packages(smollm2_path: Path) -> None:
    """gRPC, mDNS and TLS serve only a ring; on one device they were ~27 MiB of peak RSS."""
    done = run_python(
        RING_ONLY, str(smollm2_path), timeout=600, env={"NUMBA_CACHE_DIR": str(compile_cache.cache_dir())}
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
