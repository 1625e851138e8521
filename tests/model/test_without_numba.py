"""Without numba (a device where it does not install) prima still runs, on gguf-py's dequantizer,
BLAS and the numpy glue, and still matches llama.cpp's logits within the exact-mode tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import load_oracle
from tests.forward.test_transformer import F32_TOLERANCE

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
