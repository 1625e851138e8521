"""The per-layer glue of prima.kernels.ops_compiled in numpy, for a device without numba.

Same functions, same arguments, same float32 arithmetic as the numba kernels (which are faster:
at decode a numpy call costs more than the math); prima.forward.windowed_model uses this module only
when ops_compiled cannot be imported.
"""

from __future__ import annotations

import numpy as np

from prima.kernels import ops_reference as ops
from prima.kernels.ops_reference import ROPE_NEOX, QkvSplit

NONE = np.empty(0, dtype=np.float32)  # "no such weight" for the optional arguments below


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return ops.rms_norm(x, w, eps).astype(np.float32)


def residual_norm(
    x: np.ndarray, y: np.ndarray, post_w: np.ndarray, norm_w: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """h = x + post_norm(y) (post_norm skipped when post_w is empty); returns (h, norm(h) * norm_w)
    (the second is empty when norm_w is)."""
    h = x + (rms_norm(y, post_w, eps) if post_w.size else y)
    hn = rms_norm(h, norm_w, eps) if norm_w.size else np.empty((0, x.shape[1]), dtype=np.float32)
    return h, hn


def qkv_rope(
    qkv: np.ndarray, s: QkvSplit, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split qkv (n, (H + 2 KVH) hd) into q (n, H, hd), k, v (n, KVH, hd); biases, QK norms, RoPE."""
    n = qkv.shape[0]
    kv0 = s.n_heads * s.head_dim
    v0 = kv0 + s.n_kv_heads * s.head_dim
    parts = []
    for lo, hi, heads, bias in (
        (0, kv0, s.n_heads, s.q_bias),
        (kv0, v0, s.n_kv_heads, s.k_bias),
        (v0, None, s.n_kv_heads, s.v_bias),
    ):
        part = qkv[:, lo:hi] + bias if bias.size else qkv[:, lo:hi]
        parts.append(np.ascontiguousarray(part, dtype=np.float32).reshape(n, heads, s.head_dim))
    q, k, v = parts
    if s.q_norm.size:
        q = rms_norm(q, s.q_norm, s.eps)
    if s.k_norm.size:
        k = rms_norm(k, s.k_norm, s.eps)
    return _rope(q, positions, s.inv_freq, s.neox), _rope(k, positions, s.inv_freq, s.neox), v


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, neox: bool) -> np.ndarray:
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    half = inv_freq.shape[0]
    out = x.copy()
    if neox:
        a, b = slice(0, half), slice(half, 2 * half)
    else:
        a, b = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., a] * sin + x[..., b] * cos
    return out


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    t: int,
    positions: np.ndarray,
    scale: float,
    window: int,
) -> np.ndarray:
    """Causal grouped-query attention of q (n, H, hd) over cache rows [0, t); (n, H * hd)."""
    k, v = k_cache[:t].astype(np.float32, copy=False), v_cache[:t].astype(np.float32, copy=False)
    return ops.attention(q, k, v, positions, scale, window, k_cache.dtype == np.float16).astype(np.float32)


def glu(gate_up: np.ndarray, ffn_dim: int, activation: str) -> np.ndarray:
    """act(gate) * up from the merged gate/up projection."""
    gate, up = gate_up[:, :ffn_dim], gate_up[:, ffn_dim:]
    act = ops.gelu(gate) if activation == "gelu" else ops.silu(gate)
    return (act * up).astype(np.float32)


def glu_in_place(gate_up: np.ndarray, ffn_dim: int, activation: str) -> np.ndarray:
    """glu; numpy allocates its result anyway (the numba glue reuses gate_up's memory)."""
    return glu(gate_up, ffn_dim, activation)


def rope_inv_freq(rope_dim: int, base: float) -> np.ndarray:
    return ops.rope_inv_freq(rope_dim, base)


def is_neox(rope_type: str) -> bool:
    return rope_type == ROPE_NEOX
