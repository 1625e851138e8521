"""The per-layer glue of the forward pass as numba kernels: each replaces a chain of numpy calls
whose dispatch overhead, at decode (one token), costs more than the arithmetic. Here: norms,
the QKV split with RoPE, and the gated feed-forward activations; attention is in
prima.kernels.attention_compiled, and `attention` is offered here too, so that this module and
prima.kernels.ops_numpy are the same set of functions.

Each mirrors a float32 reference in prima.kernels.ops_reference (the tests compare them); reductions may
be summed in another order, so results agree to float32 rounding, not bit for bit. Optional
weights are passed as empty arrays so that one compiled variant serves every architecture.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from prima.kernels import ops_reference as ops
from prima.kernels.attention_compiled import attention as attention
from prima.kernels.lanes import exp_f32, half_bits
from prima.kernels.ops_reference import ROPE_NEOX, QkvSplit

NONE = np.empty(0, dtype=np.float32)  # "no such weight" for the optional arguments below


@njit(cache=True, inline="always")
def _norm_row(x: np.ndarray, w: np.ndarray, eps: float, y: np.ndarray) -> None:
    ss = 0.0
    for j in range(x.shape[0]):
        ss += np.float64(x[j]) * np.float64(x[j])
    scale = np.float32(1.0 / math.sqrt(ss / x.shape[0] + eps))
    for j in range(x.shape[0]):
        y[j] = (x[j] * scale) * w[j]


@njit(cache=True)
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (n, d) normalized over d (sum of squares in float64, as ops.rms_norm), times w (d,)."""
    y = np.empty_like(x)
    for i in range(x.shape[0]):
        _norm_row(x[i], w, eps, y[i])
    return y


@njit(cache=True, inline="always")
def _residual_row(x, y, post_w, norm_w, eps, h, hn, tmp, i) -> None:
    """Row i of residual_norm_rows into h and hn (tmp: scratch of d floats)."""
    if post_w.size:
        _norm_row(y[i], post_w, eps, tmp)
    else:
        tmp[:] = y[i]
    for j in range(x.shape[1]):
        h[i, j] = x[i, j] + tmp[j]
    if norm_w.size:
        _norm_row(h[i], norm_w, eps, hn[i])


@njit(cache=True)
def residual_norm_rows(
    x: np.ndarray, y: np.ndarray, post_w: np.ndarray, norm_w: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """h = x + post_norm(y) (post_norm skipped when post_w is empty); returns (h, norm(h) * norm_w)
    (the second is empty when norm_w is): a block's residual add and the next block's input norm."""
    n, d = x.shape
    h = np.empty_like(x)
    tmp = np.empty(d, dtype=np.float32)
    hn = np.empty((n if norm_w.size else 0, d), dtype=np.float32)
    for i in range(n):
        _residual_row(x, y, post_w, norm_w, eps, h, hn, tmp, i)
    return h, hn


@njit(parallel=True, cache=True)
def _residual_norm_parallel(
    x: np.ndarray, y: np.ndarray, post_w: np.ndarray, norm_w: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """residual_norm_rows with rows split over the threads (the same bits)."""
    n, d = x.shape
    h = np.empty_like(x)
    hn = np.empty((n if norm_w.size else 0, d), dtype=np.float32)
    for i in prange(n):
        tmp = np.empty(d, dtype=np.float32)
        _residual_row(x, y, post_w, norm_w, eps, h, hn, tmp, i)
    return h, hn


# From this many rows (prefill) the row-wise glue runs on every thread; at decode a parallel
# launch would cost more than the few rows' math.
PARALLEL_MIN_ROWS = 8


def residual_norm(
    x: np.ndarray, y: np.ndarray, post_w: np.ndarray, norm_w: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """residual_norm_rows, its rows over the threads from PARALLEL_MIN_ROWS rows."""
    run = _residual_norm_parallel if x.shape[0] >= PARALLEL_MIN_ROWS else residual_norm_rows
    return run(x, y, post_w, norm_w, eps)


@njit(cache=True, inline="always")
def _qkv_row(
    qkv: np.ndarray,
    s: QkvSplit,
    positions: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    i: int,
) -> None:
    """Row i of qkv_rope_rows into q, k, v (cos and sin: scratch of rope_dim / 2 floats)."""
    n_heads, n_kv_heads, head_dim = s.n_heads, s.n_kv_heads, s.head_dim
    half = s.inv_freq.shape[0]
    kv0 = n_heads * head_dim
    v0 = kv0 + n_kv_heads * head_dim
    for f in range(half):
        angle = np.float64(positions[i]) * s.inv_freq[f]
        cos[f] = np.float32(math.cos(angle))
        sin[f] = np.float32(math.sin(angle))
    for h in range(n_heads + n_kv_heads):
        if h < n_heads:
            dst = q[i, h]
            src = qkv[i, h * head_dim : (h + 1) * head_dim]
            bias, norm, b0 = s.q_bias, s.q_norm, h * head_dim
        else:
            dst = k[i, h - n_heads]
            src = qkv[i, kv0 + (h - n_heads) * head_dim : kv0 + (h - n_heads + 1) * head_dim]
            bias, norm, b0 = s.k_bias, s.k_norm, (h - n_heads) * head_dim
        for j in range(head_dim):
            dst[j] = src[j] + bias[b0 + j] if bias.size else src[j]
        if norm.size:
            _norm_row(dst, norm, s.eps, dst)
        _rope_row(dst, cos, sin, s.neox)
    for h in range(n_kv_heads):
        for j in range(head_dim):
            val = qkv[i, v0 + h * head_dim + j]
            v[i, h, j] = val + s.v_bias[h * head_dim + j] if s.v_bias.size else val


@njit(cache=True)
def qkv_rope_rows(
    qkv: np.ndarray, s: QkvSplit, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the merged projection qkv (n, (H + 2 KVH) hd) into q (n, H, hd), k, v (n, KVH, hd),
    add biases, apply the per-head QK norms, and rotate q and k by RoPE at `positions`."""
    n = qkv.shape[0]
    q = np.empty((n, s.n_heads, s.head_dim), dtype=np.float32)
    k = np.empty((n, s.n_kv_heads, s.head_dim), dtype=np.float32)
    v = np.empty((n, s.n_kv_heads, s.head_dim), dtype=np.float32)
    cos = np.empty(s.inv_freq.shape[0], dtype=np.float32)
    sin = np.empty(s.inv_freq.shape[0], dtype=np.float32)
    for i in range(n):
        _qkv_row(qkv, s, positions, q, k, v, cos, sin, i)
    return q, k, v


@njit(parallel=True, cache=True)
def _qkv_rope_parallel(
    qkv: np.ndarray, s: QkvSplit, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qkv_rope_rows with rows split over the threads (the same bits)."""
    n = qkv.shape[0]
    q = np.empty((n, s.n_heads, s.head_dim), dtype=np.float32)
    k = np.empty((n, s.n_kv_heads, s.head_dim), dtype=np.float32)
    v = np.empty((n, s.n_kv_heads, s.head_dim), dtype=np.float32)
    for i in prange(n):
        cos = np.empty(s.inv_freq.shape[0], dtype=np.float32)
        sin = np.empty(s.inv_freq.shape[0], dtype=np.float32)
        _qkv_row(qkv, s, positions, q, k, v, cos, sin, i)
    return q, k, v


def qkv_rope(
    qkv: np.ndarray, s: QkvSplit, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qkv_rope_rows, its rows over the threads from PARALLEL_MIN_ROWS rows."""
    run = _qkv_rope_parallel if qkv.shape[0] >= PARALLEL_MIN_ROWS else qkv_rope_rows
    return run(qkv, s, positions)


@njit(cache=True, inline="always")
def _rope_row(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
    half = cos.shape[0]
    for f in range(half):
        if neox:
            a, b = f, f + half
        else:
            a, b = 2 * f, 2 * f + 1
        x0 = x[a]
        x1 = x[b]
        x[a] = x0 * cos[f] - x1 * sin[f]
        x[b] = x0 * sin[f] + x1 * cos[f]


@njit(cache=True, inline="always")
def _silu_row(gate_up: np.ndarray, ffn_dim: int, out: np.ndarray, i: int) -> None:
    """Row i: the exponentials in a loop of their own, which vectorizes (fused into the product,
    LLVM leaves them scalar)."""
    g, u, o = gate_up[i, :ffn_dim], gate_up[i, ffn_dim:], out[i]
    for j in range(ffn_dim):
        o[j] = exp_f32(-g[j])
    for j in range(ffn_dim):
        o[j] = g[j] / (np.float32(1.0) + o[j]) * u[j]


@njit(cache=True)
def silu_mul(gate_up: np.ndarray, ffn_dim: int) -> np.ndarray:
    """gate_up (n, 2 ffn) = [gate | up] -> silu(gate) * up (n, ffn), as ops.silu."""
    n = gate_up.shape[0]
    out = np.empty((n, ffn_dim), dtype=np.float32)
    for i in range(n):
        _silu_row(gate_up, ffn_dim, out, i)
    return out


@njit(parallel=True, cache=True)
def _silu_mul_parallel(gate_up: np.ndarray, ffn_dim: int) -> np.ndarray:
    """silu_mul with rows split over the threads (the same bits)."""
    n = gate_up.shape[0]
    out = np.empty((n, ffn_dim), dtype=np.float32)
    for i in prange(n):
        _silu_row(gate_up, ffn_dim, out, i)
    return out


@njit(cache=True, inline="always")
def _gelu_row(gate_up: np.ndarray, ffn_dim: int, table: np.ndarray, out: np.ndarray, i: int) -> None:
    for j in range(ffn_dim):
        g = gate_up[i, j]
        if g <= np.float32(-10.0):
            y = np.float32(0.0)
        elif g >= np.float32(10.0):
            y = g
        else:
            y = table[half_bits(g)]
        out[i, j] = y * gate_up[i, ffn_dim + j]


@njit(cache=True)
def gelu_mul(gate_up: np.ndarray, ffn_dim: int, table: np.ndarray) -> np.ndarray:
    """gelu(gate) * up through ggml's fp16 table (ops.gelu_fp16_table), bit for bit as ops.gelu."""
    n = gate_up.shape[0]
    out = np.empty((n, ffn_dim), dtype=np.float32)
    for i in range(n):
        _gelu_row(gate_up, ffn_dim, table, out, i)
    return out


@njit(parallel=True, cache=True)
def _gelu_mul_parallel(gate_up: np.ndarray, ffn_dim: int, table: np.ndarray) -> np.ndarray:
    """gelu_mul with rows split over the threads (the same bits)."""
    n = gate_up.shape[0]
    out = np.empty((n, ffn_dim), dtype=np.float32)
    for i in prange(n):
        _gelu_row(gate_up, ffn_dim, table, out, i)
    return out


def glu(gate_up: np.ndarray, ffn_dim: int, activation: str) -> np.ndarray:
    """act(gate) * up from the merged gate/up projection; GELU through ggml's fp16 table."""
    parallel = gate_up.shape[0] >= PARALLEL_MIN_ROWS
    if activation == "gelu":
        gelu = _gelu_mul_parallel if parallel else gelu_mul
        return gelu(gate_up, ffn_dim, ops.gelu_fp16_table())
    return (_silu_mul_parallel if parallel else silu_mul)(gate_up, ffn_dim)


def glu_in_place(gate_up: np.ndarray, ffn_dim: int, activation: str) -> np.ndarray:
    """glu (the same bits), written over gate_up, which the caller gives up: from PARALLEL_MIN_ROWS
    rows (prefill) the result is a view of gate_up's first rows, so a block's feed-forward holds
    one (n, 2 ffn) array instead of that and an (n, ffn) one (SmolLM2, 128 rows: 0.75 MiB, the
    step that set the first layer's heap growth)."""
    n = gate_up.shape[0]
    if n < PARALLEL_MIN_ROWS or not gate_up.flags.c_contiguous or gate_up.dtype != np.float32:
        return glu(gate_up, ffn_dim, activation)
    table = ops.gelu_fp16_table() if activation == "gelu" else NONE
    _glu_rows_in_place(gate_up, ffn_dim, activation == "gelu", table)
    flat = gate_up.reshape(-1)
    _pack_rows(flat, n, ffn_dim)
    return flat[: n * ffn_dim].reshape(n, ffn_dim)


@njit(parallel=True, cache=True)
def _glu_rows_in_place(gate_up: np.ndarray, ffn_dim: int, gelu: bool, table: np.ndarray) -> None:
    """Each row's activation into its own gate half (row by row as glu computes it)."""
    for i in prange(gate_up.shape[0]):
        if gelu:
            _gelu_row(gate_up, ffn_dim, table, gate_up, i)
        else:
            exps = np.empty((1, ffn_dim), dtype=np.float32)
            _silu_row(gate_up[i : i + 1], ffn_dim, exps, 0)
            gate_up[i, :ffn_dim] = exps[0]


@njit(cache=True)
def _pack_rows(flat: np.ndarray, n: int, width: int) -> None:
    """Move row i's first `width` values from flat[2 i width] to flat[i width], in row order, so
    that no row is overwritten before it has moved."""
    for i in range(1, n):
        flat[i * width : (i + 1) * width] = flat[2 * i * width : 2 * i * width + width]


def rope_inv_freq(rope_dim: int, base: float) -> np.ndarray:
    """Inverse frequencies (rope_dim / 2,) float64, as ops.rope uses them."""
    return ops.rope_inv_freq(rope_dim, base)


def is_neox(rope_type: str) -> bool:
    return rope_type == ROPE_NEOX
