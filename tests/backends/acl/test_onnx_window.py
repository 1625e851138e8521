"""The ONNX graph of a window (prima.backends.acl.onnx_window), run in onnxruntime on the CPU
with its float16 roundings made explicit (fake_acl.with_fp16_rounding), against the CPU backend
in exact mode: the same hidden states within float16 arithmetic
(error <= 3e-3 of the largest value, cosine >= 0.9999), through a prefill and a decode
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

from tests.backends.acl.fake_acl import with_fp16_rounding  # noqa: E402

CTX = 32
PROMPT = np.array([1, 50, 300, 7, 9, 11])
NEXT = np.array([42])


class OrtWindow:
    """A window graph in onnxruntime with its KV cache in numpy, written back after each call."""

    def __init__(self, weights: ModelWeights, layers: range, kv_dtype: str = "float16") -> None:
        self.cfg = weights.config
        self.spec = onnx_window.window_graph(self.cfg, layers, CTX)
        model = onnx_window.export_window(weights, layers, CTX, kv_dtype)
        rounded = with_fp16_rounding(model)  # as the device rounds (the CPU provider would not)
        self.session = ort.InferenceSession(rounded.SerializeToString(), providers=["CPUExecutionProvider"])
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
    """Within what six layers of float16 MatMuls give: projections and attention's scores and
    weighted values each rounded to 11 significant bits (a score of 16 moves by up to 2^-7, which
    shifts its probability by ~0.8%); measured up to 2.0e-3 of the largest value on Gemma 3."""
    err = float(np.abs(got - want).max())
    assert err <= 3e-3 * float(np.abs(want).max()), err
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


def test_every_matmul_of_a_window_runs_in_float16() -> None:
    """The NPU's cube unit works in float16, and both projects that run LLMs on a 310B keep
    attention's QK^T and PV there too: no MatMul of a window (projections or attention) may take
    float32, which --precision_mode=must_keep_origin_dtype would keep as float32."""
    import onnx

    weights = open_model(tiny_model_path(TINY_TAGS[0])).weights
    model = onnx.shape_inference.infer_shapes(onnx_window.export_window(weights, range(2), CTX, "float32"))
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.input)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    matmuls = [node for node in model.graph.node if node.op_type == "MatMul"]
    assert len(matmuls) >= 2 * 7  # q, k, v, o, gate, up, down and QK^T, PV per layer
    for node in matmuls:
        assert {types[i] for i in node.input} == {onnx.TensorProto.FLOAT16}, node.name


def test_the_stand_in_rounds_as_float16_matmuls_do() -> None:
    """with_fp16_rounding makes onnxruntime's CPU provider (which computes a float16 MatMul in
    float32 and keeps no rounding) give what float16 inputs and a float16 result give."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["a"], ["a16"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["b"], ["b16"], to=TensorProto.FLOAT16),
            helper.make_node("MatMul", ["a16", "b16"], ["c16"]),
            helper.make_node("Cast", ["c16"], ["c"], to=TensorProto.FLOAT),
        ],
        "mm",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in "ab"],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 4)).astype(np.float32) * 3 for _ in range(2))
    rounded = with_fp16_rounding(onnx.ModelProto.FromString(model.SerializeToString()))
    session = ort.InferenceSession(rounded.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["c"], {"a": a, "b": b})[0]
    a16, b16 = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, (a16 @ b16).astype(np.float16).astype(np.float32))
