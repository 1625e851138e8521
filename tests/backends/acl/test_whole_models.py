"""The two test models each as one NPU window, through FakeAcl and the stand-in ATC with the
rules of the real ones enforced (docs/backends.md): all 30 layers of SmolLM2 in one offline
model (the packed KV cache keeps a gear at 14 dims of pyACL's 128), and Gemma 3 with its
sliding-window layers (its two masks one input, keeping ATC's 4 dynamic dims per gear). The
prompt logits are within the acl backend's tolerance of llama.cpp's f32 run, with its top token
(measured here, the stand-in rounding as float16 MatMuls do: <= 0.043 for both). No NPU result: onnxruntime runs the graphs on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.model.files import open_model
from tests.conftest import load_oracle

pytest.importorskip("onnxruntime")

from prima.backends.acl import AclBackend
from tests.backends.acl.fake_acl import fake_cann

pytestmark = pytest.mark.slow

CTX = 64  # the oracle's short prompts fit


@pytest.mark.parametrize("tag", ["smollm2-135m", "gemma3-270m"])
def test_a_whole_model_runs_as_one_npu_window(
    tag: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path = request.getfixturevalue("smollm2_path" if tag.startswith("smollm2") else "gemma3_path")
    weights = open_model(path).weights
    n = weights.config.n_layers
    with fake_cann(tmp_path, memory_bytes=4 << 30):
        backend = AclBackend(weights, threads=2, ctx=CTX)
        window = backend.load_window(range(n))
        assert window.graph.sliding == (tag == "gemma3-270m")
        for prompt in load_oracle(tag)["prompts"][:2]:  # capital, code: under CTX tokens
            ids = np.array(prompt["prompt_token_ids"])
            kv = backend.new_kv(CTX, range(n))
            h = backend.run_window(window, backend.embed(ids), np.arange(len(ids)), kv)
            logits = backend.logits(h[-1:])[0]
            f32 = prompt["f32"]["logits"]
            assert np.abs(logits - f32).max() <= backend.logit_tolerance, prompt["name"]
            assert int(np.argmax(logits)) == int(np.argmax(f32)), prompt["name"]
            kv.free()
        backend.release_window(window)
        backend.close()
