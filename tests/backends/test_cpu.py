"""The cpu backend is found by name, checks its settings, and its matmuls (CpuOps) agree with
gguf-py's dequantization."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.backends import get_backend
from prima.backends.cpu import CpuBackend, CpuOps
from prima.backends.reference import BlockParams, block
from prima.errors import InputError
from prima.kernels.tensor import QTensor
from prima.model.files import open_model
from prima.model.weights import ModelWeights
from tests.conftest import tiny_model_path
from tests.kernels.weights import random_qtensor, reference, relative_error
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return open_model(tiny_model_path("tiny-qwen2")).weights


def test_get_backend_cpu_returns_cpu_backend(weights: ModelWeights) -> None:
    backend = get_backend("cpu", weights, threads=1)
    assert isinstance(backend, CpuBackend)
    assert backend.name == "cpu"
    assert backend.ops.threads == 1
    assert backend.config is weights.config


def test_get_backend_unknown_name_lists_available(weights: ModelWeights) -> None:
    with pytest.raises(InputError, match="unknown backend 'tpu'; available: cpu"):
        get_backend("tpu", weights)


def test_cpu_ops_reject_zero_threads() -> None:
    with pytest.raises(ValueError, match="threads"):
        CpuOps(threads=0)


def test_cpu_backend_defaults_to_q8_and_rejects_unknown_modes(weights: ModelWeights) -> None:
    assert CpuBackend(weights, threads=1).mode == "q8"
    assert get_backend("cpu", weights, threads=1, mode="exact").mode == "exact"
    with pytest.raises(InputError, match="unknown cpu mode 'fast'; available: q8, exact"):
        CpuBackend(weights, mode="fast")


def test_cpu_ops_q8_matmul_is_close_to_exact() -> None:
    w = random_qtensor(GGMLQuantizationType.Q4_K, rows=9, cols=256)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    assert relative_error(CpuOps(mode="q8").matmul(w, x), x, reference(w)) < 5e-3


def test_cpu_ops_matmul_and_get_rows() -> None:
    ops = CpuOps(mode="exact")
    w = random_qtensor(GGMLQuantizationType.Q4_K, rows=9, cols=256)
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    assert relative_error(ops.matmul(w, x), x, reference(w)) < 1e-5
    rows = ops.get_rows(w, np.array([8, 1]))
    np.testing.assert_allclose(rows, reference(w)[[8, 1]], rtol=1e-6, atol=1e-7)


def test_the_backends_matmul_runs_in_its_mode(weights: ModelWeights) -> None:
    """What the profiler times is the arithmetic the backend runs: q8 differs from exact."""
    w = random_qtensor(GGMLQuantizationType.Q4_K, rows=9, cols=256)
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    q8 = CpuBackend(weights, mode="q8").matmul(w, x)
    exact = CpuBackend(weights, mode="exact").matmul(w, x)
    np.testing.assert_array_equal(exact, CpuOps(mode="exact").matmul(w, x))
    np.testing.assert_array_equal(q8, CpuOps(mode="q8").matmul(w, x))
    assert not np.array_equal(q8, exact)


def test_batches_keep_single_token_bits_on_every_weight_type(
    weights: ModelWeights, smollm2_path: Path, tmp_path: Path
) -> None:
    """Quantized and float projections and head: up to FUSED_MAX_N rows computed independently
    (speculative decoding checks drafts in such batches; tests/engine/test_speculative.py holds
    it to it)."""
    f32 = CpuBackend(weights)
    assert f32.batch_identical_tokens == f32.fused_max_tokens > 1
    quantized = CpuBackend(open_model(smollm2_path).weights)
    assert quantized.batch_identical_tokens == quantized.fused_max_tokens > 1
    for qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        path = write_tiny_model(tmp_path / f"{qtype.name}.gguf", qtype=qtype)
        halves = CpuBackend(open_model(path).weights)
        assert halves.batch_identical_tokens == halves.fused_max_tokens > 1, qtype.name


class _KeepingWeakRefs:
    """CpuOps whose every product is also remembered weakly, so a test can ask which of them
    the caller still holds when the next matmul starts."""

    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops
        self.products: list[weakref.ref[np.ndarray]] = []
        self.alive_at_call: list[int] = []

    def _run(self, product: np.ndarray) -> np.ndarray:
        self.products.append(weakref.ref(product))
        return product

    def _starting(self) -> None:
        self.alive_at_call.append(sum(ref() is not None for ref in self.products))

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        self._starting()
        return self._run(self.ops.matmul(w, x))

    def matmul_many(self, ws: Sequence[QTensor], x: np.ndarray) -> np.ndarray:
        self._starting()
        return self._run(self.ops.matmul_many(ws, x))

    def get_rows(self, w: QTensor, ids: np.ndarray) -> np.ndarray:
        return self.ops.get_rows(w, ids)


def test_a_prefill_block_drops_each_projection_once_read(smollm2_path: Path) -> None:
    """Peak memory: at a 128-token prefill the block's (n, 2 ffn) products dominate a short
    prompt's resident memory, so each matmul starts with none of the earlier ones still held
    (before, ffn_down ran with q|k|v, the attention output and gate|up all alive), but for
    gate|up at ffn_down: its memory holds the activation ffn_down reads (glu_in_place)."""
    backend = CpuBackend(open_model(smollm2_path).weights, threads=1)
    cfg = backend.config
    params = BlockParams.of(backend.weights.layer(0), cfg)
    n = 128
    x = np.random.default_rng(0).standard_normal((n, cfg.d_model)).astype(np.float32)
    ops = _KeepingWeakRefs(backend.ops)
    out = block(cfg, params, ops, x, np.arange(n), backend.new_kv(n, range(1)))
    assert len(ops.alive_at_call) == 4  # q|k|v, attn_output, gate|up, ffn_down
    assert ops.alive_at_call == [0, 0, 0, 1]
    expected = block(cfg, params, backend.ops, x, np.arange(n), backend.new_kv(n, range(1)))
    assert np.array_equal(out, expected)


def _greedy_logits(backend: CpuBackend, prompt: Sequence[int], steps: int) -> list[np.ndarray]:
    """Prefill `prompt`, then decode `steps` greedy tokens one at a time; each step's logits."""
    layers = range(backend.config.n_layers)
    window = backend.load_window(layers)
    kv = backend.new_kv(64, layers)
    ids = np.asarray(prompt, dtype=np.int64)
    out = []
    h = backend.run_window(window, backend.embed(ids), np.arange(len(ids)), kv)
    out.append(backend.logits(h[-1:])[0])
    for step in range(steps):
        token = np.array([int(np.argmax(out[-1]))], dtype=np.int64)
        h = backend.run_window(window, backend.embed(token), np.array([len(ids) + step]), kv)
        out.append(backend.logits(h)[0])
    return out


@pytest.mark.skipif(os.cpu_count() == 1, reason="one core: there is no other thread count to switch to")
def test_decode_threads_switching_mid_generation_keeps_every_logit(weights: ModelWeights) -> None:
    """A decode step computes the same bits with any thread count, so moving between counts as
    the machine's load changes never changes the text."""
    fixed = CpuBackend(weights, threads=1, adapt_threads=False)
    switching = CpuBackend(weights, threads=2, adapt_threads=True)
    window = switching.load_window(range(weights.config.n_layers))
    chooser = switching.decode_threads(window)
    assert chooser is not None
    counts = iter([2, 1] * 20)
    used: list[int] = []

    def alternate() -> int:
        used.append(next(counts))
        return used[-1]

    chooser.next_threads = alternate  # type: ignore[method-assign]
    want = _greedy_logits(fixed, [1, 2, 3, 4, 5], 12)
    got = _greedy_logits(switching, [1, 2, 3, 4, 5], 12)
    assert set(used) == {1, 2}
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_threads_reach_numba_and_step_times_reach_the_chooser(weights: ModelWeights) -> None:
    import numba

    backend = CpuBackend(weights, threads=2, adapt_threads=True)
    window = backend.load_window(range(weights.config.n_layers))
    chooser = backend.decode_threads(window)
    assert chooser is not None
    recorded: list[tuple[int, float]] = []
    chooser.next_threads = lambda: 1  # type: ignore[method-assign]
    chooser.record = lambda n, ms: recorded.append((n, ms))  # type: ignore[method-assign]
    kv = backend.new_kv(16, window.layers)
    h = backend.run_window(window, backend.embed(np.array([1, 2, 3])), np.arange(3), kv)
    assert recorded == []  # a prompt of three tokens is not a decode step
    backend.run_window(window, h[-1:], np.array([3]), kv)
    assert numba.get_num_threads() == 1
    assert [n for n, _ in recorded] == [1]
    assert recorded[0][1] > 0


def test_decode_threads_fixed_when_asked_or_one_thread(
    weights: ModelWeights, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = CpuBackend(weights, threads=1).load_window(range(1))
    assert CpuBackend(weights, threads=1).decode_threads(window) is None
    assert CpuBackend(weights, threads=2, adapt_threads=False).decode_threads(window) is None
    monkeypatch.setenv("PRIMA_DECODE_THREADS", "fixed")
    assert CpuBackend(weights, threads=2).decode_threads(window) is None
    monkeypatch.delenv("PRIMA_DECODE_THREADS")
    assert CpuBackend(weights, threads=2).decode_threads(window) is not None
