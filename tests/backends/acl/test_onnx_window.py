"""The ONNX graph of a window (prima.backends.acl.onnx_window), run in onnxruntime on the CPU,
against the CPU backend in exact mode: the same hidden states within float16 arithmetic
(relative error <= 2e-3 of the largest value, cosine >= 0.9999), through a prefill and a decode
step that reads the keys and values the prefill wrote back into the cache, kept in float16 (the
default) or float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.backends import get_backend
from prima.model.files import open_model
from prima.model.weights import ModelWeights
from tests.conftest import tiny_model_path
from tests.tiny_qwen import TINY_TAGS

ort = pytest.importorskip("onnxruntime")
onnx_window = pytest.importorskip("prima.backends.acl.onnx_window")

CTX = 32
PROMPT = np.array([1, 50, 300, 7, 9, 11])
NEXT = np.array([42])


class OrtWindow:
    """A window graph in onnxruntime with its KV cache in numpy, written back after each call."""

    def __init__(self, weights: ModelWeights, layers: range, kv_dtype: str = "float16") -> None:
        self.cfg = weights.config
        self.spec = onnx_window.window_graph(self.cfg, layers, CTX)
        model = onnx_window.export_window(weights, layers, CTX, kv_dtype)
        self.session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.past = {n: np.zeros(self.spec.shape(n, 0), kv_dtype) for n in ("past_k", "past_v")}

    def run(self, hidden: np.ndarray, positions: np.ndarray) -> np.ndarray:
        mask = onnx_window.window_masks(self.cfg, self.spec, positions)
        feed = {"hidden": hidden, "positions": positions, "mask": mask}
        outs = dict(
            zip(
                self.spec.outputs,
                self.session.run(list(self.spec.outputs), {**feed, **self.past}),
                strict=True,
            )
        )
        for c in "kv":  # (L, n, KVH, hd) into (L, ctx, KVH, hd)
            self.past[f"past_{c}"][:, positions[0] : positions[-1] + 1] = outs[f"new_{c}"]
        return outs["hidden_out"]


def assert_close_fp16(got: np.ndarray, want: np.ndarray) -> None:
    err = float(np.abs(got - want).max())
    assert err <= 2e-3 * float(np.abs(want).max()), err
    cos = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert cos >= 0.9999, cos


def check_windows(weights: ModelWeights, windows: list[range], kv_dtype: str = "float16") -> None:
    """Chain `windows` through onnxruntime (a `kv_dtype` cache) and through the CPU backend."""
    cpu = get_backend("cpu", weights, threads=1, mode="exact")
    h_prompt, h_next = cpu.embed(PROMPT), cpu.embed(NEXT)
    for layers in windows:
        handle, kv = cpu.load_window(layers), cpu.new_kv(CTX, layers)
        graph = OrtWindow(weights, layers, kv_dtype)
        want_prompt = cpu.run_window(handle, h_prompt, np.arange(len(PROMPT)), kv)
        want_next = cpu.run_window(handle, h_next, np.array([len(PROMPT)]), kv)
        assert_close_fp16(graph.run(h_prompt, np.arange(len(PROMPT))), want_prompt)
        assert_close_fp16(graph.run(h_next, np.array([len(PROMPT)])), want_next)
        h_prompt, h_next = want_prompt, want_next


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
@pytest.mark.parametrize("tag", TINY_TAGS)
def test_window_graphs_of_tiny_models_match_the_cpu_backend(tag: str, kv_dtype: str) -> None:
    weights = open_model(tiny_model_path(tag)).weights
    n = weights.config.n_layers
    check_windows(weights, [range(n)], kv_dtype)
    check_windows(weights, [range(i, i + 1) for i in range(n)], kv_dtype)


def test_attention_mask_sees_the_past_and_earlier_new_tokens() -> None:
    mask = onnx_window.attention_mask(np.array([2, 3]), ctx=4, window=0) == 0
    # past slots 0..3 (only 0 and 1 written before position 2), then the two new tokens
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]])
    swa = onnx_window.attention_mask(np.array([2, 3]), ctx=4, window=2) == 0
    np.testing.assert_array_equal(swa, [[0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]])


@pytest.mark.slow
def test_every_window_of_the_test_models_matches_the_cpu_backend(
    smollm2_path: Path, gemma3_path: Path
) -> None:
    """Both test models, cut into windows of 6 layers covering every layer (> 5 s: dequantizing
    each layer to fp16 and building its graph)."""
    for path in (smollm2_path, gemma3_path):
        weights = open_model(path).weights
        n = weights.config.n_layers
        check_windows(weights, [range(i, min(i + 6, n)) for i in range(0, n, 6)])
