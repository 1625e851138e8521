"""Elementwise and attention operations of the forward pass, in float32 numpy.

These follow llama.cpp's CPU definitions closely enough to match its float32 logits to ~1e-4:
RMSNorm sums squares in float64, GELU goes through an fp16 table like ggml's `ggml_vec_gelu_f32`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import numpy as np

# RoPE layouts (llama.cpp's names): NORM rotates adjacent pairs (x0, x1); NEOX rotates
# (x_i, x_{i+d/2}).
ROPE_NORM = "norm"
ROPE_NEOX = "neox"


class QkvSplit(NamedTuple):
    """How one layer turns its merged q|k|v projection into attention's q, k and v: the heads,
    the biases and per-head QK norms (empty arrays where the model has none), and RoPE's
    frequencies and layout. Built once per layer and passed whole to each op set's qkv_rope
    (numba takes a NamedTuple as one argument)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_bias: np.ndarray
    k_bias: np.ndarray
    v_bias: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    eps: float
    inv_freq: np.ndarray
    neox: bool


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (n, d) or (n, h, d) normalized over the last axis, times `weight` (d,)."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@lru_cache(maxsize=1)
def gelu_fp16_table() -> np.ndarray:
    # ggml evaluates GELU (tanh approximation) once per fp16 value and looks results up; we do
    # the same so that Gemma's activations round exactly as llama.cpp's do.
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (
            0.5
            * x
            * (1.0 + np.tanh(np.float32(0.7978845608028654) * x * (1.0 + np.float32(0.044715) * x * x)))
        )
    return y.astype(np.float16).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation, evaluated through an fp16 lookup as ggml's CPU backend does."""
    table = gelu_fp16_table()
    y = table[x.astype(np.float16).view(np.uint16)]
    y = np.where(x <= -10.0, np.float32(0.0), y)
    return np.where(x >= 10.0, x, y).astype(np.float32)


@lru_cache(maxsize=16)
def rope_inv_freq(rope_dim: int, base: float) -> np.ndarray:
    return base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)


def rope(x: np.ndarray, positions: np.ndarray, base: float, rope_dim: int, rope_type: str) -> np.ndarray:
    """Rotary position embedding on x (n, heads, head_dim) at `positions` (n,). NORM rotates
    adjacent pairs, NEOX rotates (i, i + rope_dim/2); dims past rope_dim pass through."""
    angles = positions.astype(np.float64)[:, None] * rope_inv_freq(rope_dim, base)[None, :]
    cos = np.cos(angles).astype(np.float32)[:, None, :]  # (n, 1, rope_dim/2)
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    out = x.copy()
    half = rope_dim // 2
    if rope_type == ROPE_NEOX:
        x0, x1 = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:rope_dim] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
        out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    return out


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    scale: float,
    window: int = 0,
    halves: bool = False,
    to_halves: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Causal grouped-query attention of new queries over the cache.

    q: (n, H, hd) for tokens at `positions`; k_cache, v_cache: (T, KVH, hd) holding keys for
    positions [0, T) with T = positions.max() + 1. `window` > 0 masks keys `window` or more
    positions behind the query (sliding-window layers). `halves`: the cache holds float16, and
    the queries and the softmax weights are rounded to float16 before meeting it, as llama.cpp's
    matmuls with a float16 operand round the other one (by `to_halves`, which may round in place;
    numpy's astype by default). Returns (n, H * hd).
    """
    n, n_heads, hd = q.shape
    t, n_kv, _ = k_cache.shape
    group = n_heads // n_kv
    # (KVH, group * n, hd) x (KVH, hd, T) -> (KVH, group * n, T)
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd)
    rounded = to_halves or _to_half_and_back
    if halves:
        qg = rounded(np.array(qg, dtype=np.float32))  # a copy: never round the caller's q
    scores = np.matmul(qg, k_cache.transpose(1, 2, 0)) * np.float32(scale)
    key_pos = np.arange(t)
    rel = positions[:, None] - key_pos[None, :]  # (n, T): how far behind the query each key is
    masked = rel < 0
    if window:
        masked |= rel >= window
    scores = scores.reshape(n_kv, group, n, t)
    scores[:, :, masked] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    if halves:
        scores = rounded(scores)
    out = np.matmul(scores.reshape(n_kv, group * n, t), v_cache.transpose(1, 0, 2))  # (KVH, group*n, hd)
    return out.reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3).reshape(n, n_heads * hd)


def _to_half_and_back(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


_NO_HALVES = np.empty((0, 0, 0), dtype=np.uint16)
_NO_FLOATS = np.empty((0, 0, 0), dtype=np.float32)


def cache_forms(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(k32, v32, k16, v16): a KV cache's keys and values as the compiled kernels take them, as
    float32 or as uint16 halves, the absent pair empty (one compiled variant serves both kinds)."""
    if k.dtype == np.float16 and v.dtype == np.float16:
        return _NO_FLOATS, _NO_FLOATS, k.view(np.uint16), v.view(np.uint16)
    if k.dtype == np.float32 and v.dtype == np.float32:
        return k, v, _NO_HALVES, _NO_HALVES
    raise TypeError(f"a KV cache holds float16 or float32 (prima.weights.kv_cache), got {k.dtype}/{v.dtype}")
