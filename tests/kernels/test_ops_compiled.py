"""The numba layer glue (prima.kernels.ops_compiled: norms, the QKV split with RoPE, the gated
activations) against the numpy references in ops; attention is in test_attention_compiled.py."""

from __future__ import annotations

import numpy as np
import pytest

from prima.kernels import ops_compiled
from prima.kernels import ops_reference as ops
from prima.kernels.ops_reference import QkvSplit
from prima.model.config import ROPE_NEOX, ROPE_NORM

RNG = np.random.default_rng(7)


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_reference() -> None:
    x, w = _f32(3, 64), _f32(64)
    np.testing.assert_allclose(
        ops_compiled.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("post", [True, False])
def test_residual_norm_matches_reference(post: bool) -> None:
    x, y, pw, nw = _f32(2, 32), _f32(2, 32), _f32(32), _f32(32)
    h, hn = ops_compiled.residual_norm(x, y, pw if post else ops_compiled.NONE, nw, 1e-6)
    want = x + (ops.rms_norm(y, pw, 1e-6) if post else y)
    np.testing.assert_allclose(h, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(hn, ops.rms_norm(want, nw, 1e-6), rtol=1e-5, atol=1e-5)
    _, none = ops_compiled.residual_norm(x, y, ops_compiled.NONE, ops_compiled.NONE, 1e-6)
    assert none.shape == (0, 32)


def test_prefill_rows_on_threads_have_decode_bits() -> None:
    """From PARALLEL_MIN_ROWS rows the row-wise glue runs over the threads: each row's bits are
    those of the one-thread loop the decode block runs."""
    n, heads, kv_heads, hd = ops_compiled.PARALLEL_MIN_ROWS + 3, 4, 2, 16
    x, y, pw, nw = _f32(n, 32), _f32(n, 32), _f32(32), _f32(32)
    for got, want in zip(
        ops_compiled.residual_norm(x, y, pw, nw, 1e-6),
        ops_compiled.residual_norm_rows(x, y, pw, nw, 1e-6),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    split = QkvSplit(
        heads, kv_heads, hd, _f32(heads * hd), _f32(kv_heads * hd), _f32(kv_heads * hd), _f32(hd), _f32(hd),
        1e-6, ops_compiled.rope_inv_freq(hd, 1e4), True,
    )  # fmt: skip
    args = (_f32(n, (heads + 2 * kv_heads) * hd), split, np.arange(3, 3 + n))
    for got, want in zip(ops_compiled.qkv_rope(*args), ops_compiled.qkv_rope_rows(*args), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rope_type", [ROPE_NORM, ROPE_NEOX])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("n", [3, ops_compiled.PARALLEL_MIN_ROWS])
def test_qkv_rope_matches_reference(rope_type: str, qk_norm: bool, n: int) -> None:
    heads, kv_heads, hd = 4, 2, 16
    qkv = _f32(n, (heads + 2 * kv_heads) * hd)
    qb, kb, vb = _f32(heads * hd), _f32(kv_heads * hd), _f32(kv_heads * hd)
    qn, kn = (_f32(hd), _f32(hd)) if qk_norm else (ops_compiled.NONE, ops_compiled.NONE)
    positions = np.arange(5, 5 + n)
    base = 10000.0
    split = QkvSplit(
        heads, kv_heads, hd, qb, kb, vb, qn, kn, 1e-6, ops_compiled.rope_inv_freq(hd, base),
        ops_compiled.is_neox(rope_type),
    )  # fmt: skip
    q, k, v = ops_compiled.qkv_rope(qkv, split, positions)
    rq = (qkv[:, : heads * hd] + qb).reshape(n, heads, hd)
    rk = (qkv[:, heads * hd : (heads + kv_heads) * hd] + kb).reshape(n, kv_heads, hd)
    rv = (qkv[:, (heads + kv_heads) * hd :] + vb).reshape(n, kv_heads, hd)
    if qk_norm:
        rq, rk = ops.rms_norm(rq, qn, 1e-6), ops.rms_norm(rk, kn, 1e-6)
    rq = ops.rope(rq, positions, base, hd, rope_type)
    rk = ops.rope(rk, positions, base, hd, rope_type)
    np.testing.assert_allclose(q, rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, rk, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(v, rv)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("rows", [2, ops_compiled.PARALLEL_MIN_ROWS + 3])
def test_glu_in_place_gives_glus_bits_in_gate_ups_memory(rows: int, activation: str) -> None:
    """Prefill's rows: the activation lands in gate_up's own memory (no second array), packed
    row after row; decode's few rows take the allocating path. Either way glu's bits."""
    gate_up = _f32(rows, 96) * 4
    want = ops_compiled.glu(gate_up, 48, activation)
    got = ops_compiled.glu_in_place(gate_up, 48, activation)
    np.testing.assert_array_equal(got, want)
    assert np.shares_memory(got, gate_up) == (rows >= ops_compiled.PARALLEL_MIN_ROWS)


@pytest.mark.parametrize("rows", [2, ops_compiled.PARALLEL_MIN_ROWS + 3])
def test_glu_matches_reference(rows: int) -> None:
    """A decode's few rows on one thread, a prefill's over the threads: the same arithmetic."""
    gate_up = _f32(rows, 48)
    np.testing.assert_allclose(
        ops_compiled.glu(gate_up, 24, "silu"),
        ops.silu(gate_up[:, :24]) * gate_up[:, 24:],
        rtol=1e-6,
        atol=1e-6,
    )
    np.testing.assert_array_equal(
        ops_compiled.glu(gate_up, 24, "gelu"), ops.gelu(gate_up[:, :24]) * gate_up[:, 24:]
    )
