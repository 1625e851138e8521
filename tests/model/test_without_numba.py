"""Without numba (a device where it does not install) prima still runs, on gguf-py's dequantizer,
BLAS and the numpy glue, and still matches llama.cpp's logits within the exact-mode tolerance;
`prima run --local` reaches that path and gives llama.cpp's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import load_oracle, load_tiny_oracle, tiny_model_path
from tests.forward.test_windowed_model import F32_TOLERANCE
from tests.no_numba import env_without_numba

# Run in a child process: numba is made unimportable there before prima is imported.
_CHILD = """
import json, sys
sys.modules["numba"] = None
import numpy as np
from prima.kernels import matmul
from prima.forward.loader import load_model
assert not matmul.HAVE_NUMBA
loaded = load_model(sys.argv[1], mode="exact")
model = loaded.model
ids = json.loads(sys.argv[2])
cache = model.new_cache(len(ids) + 4)
# the prompt in two steps: a batch (prefill tiles) and one token (decode), as a session does
n = model.config.n_layers
h = model.forward_layers(model.embed(np.array(ids[:-1])), np.arange(len(ids) - 1), 0, n, cache)
h = model.forward_layers(model.embed(np.array(ids[-1:])), np.array([len(ids) - 1]), 0, n, cache)
np.save(sys.argv[3], model.output_logits(h)[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("tag", sorted(F32_TOLERANCE))
def test_runs_without_numba_and_matches_llama_cpp(tag: str, tmp_path: Path) -> None:
    prompt = load_oracle(tag)["prompts"][0]
    out = tmp_path / "logits.npy"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), *sys.path]))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, tag, json.dumps(prompt["prompt_token_ids"]), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falls back to slow numpy kernels" in proc.stderr
    logits = np.load(out)
    f32 = prompt["f32"]["logits"]
    assert np.abs(logits - f32).max() <= F32_TOLERANCE[tag]
    assert list(np.argsort(-logits)[:5]) == prompt["f32"]["top5_ids"]


@pytest.mark.parametrize(
    ("where", "mode", "run"),
    [
        (("--local",), ("--exact",), "f32"),
        (("--local",), (), "quant"),
        (("--local-ring", "2", "--windows", "2,2"), ("--exact",), "f32"),
    ],
)
def test_prima_run_without_numba_gives_llama_cpps_tokens(
    where: tuple[str, ...], mode: tuple[str, ...], run: str, tmp_path: Path
) -> None:
    """The command line end to end, numba and llvmlite unimportable in it and in its children
    (a ring's daemons): no compile is attempted and the tokens are llama.cpp's (exact mode: its
    float32 KV cache run; q8 mode: its float16 KV cache run, as prima's q8 mode keeps halves)."""
    prompt = next(p for p in load_tiny_oracle("tiny-qwen2")["prompts"] if p["name"] == "capital")
    env = env_without_numba(tmp_path)
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "kernels")
    cmd = [sys.executable, "-m", "prima.cli.main", "run", *where, *mode, "--ctx", "64", "--json"]
    model = str(tiny_model_path("tiny-qwen2"))
    done = subprocess.run(
        [*cmd, "-m", model, "-p", prompt["text"], "-n", "8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiling kernels" not in done.stderr
    assert list((tmp_path / "kernels").rglob("*.nbi")) == []  # nothing was compiled
    doc = json.loads(done.stdout)
    assert doc["prompt_token_ids"] == prompt["prompt_token_ids"]
    assert doc["token_ids"] == prompt[run]["greedy_token_ids"][:8]
    if "plan" in doc:  # the ring ran the model over both daemons
        assert len(doc["plan"]["nodes"]) == 2
    else:
        assert "falls back to slow numpy kernels" in done.stderr
