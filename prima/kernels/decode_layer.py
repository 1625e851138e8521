"""One transformer block at decode as a single compiled call.

At decode a block is a dozen small steps (norm, merged q/k/v, RoPE, cache write, attention,
output projection, residual, gate/up, activation, down, residual); run from Python, each step's
call and argument checks cost about as much as its arithmetic, ~50 us per block. Here the whole
block is one numba function that calls the same kernels (prima.kernels.drivers, ops_compiled,
attention_compiled) directly, so Python is crossed once per block. The arithmetic, and so the result, is that of the
reference block (prima.backends.reference), which prefill and other backends keep using; the
CPU backend gathers a block's arguments once (prima.backends.cpu_decode.FusedBlock).

  decode_layer(x, layer, kv, t, positions, int8, lut, attn_parallel_min)

`layer` is the block's FusedLayer (below) as FusedLayer.plain() gives it, `kv` the layer's cache as KVCache.kernel_arrays gives
it (float32 keys, values, or halves); attention runs its heads in parallel from `attn_parallel_min` (query row, key) pairs
(attention_compiled.attention_parallel_min). The caller has already checked that the cache rows [positions] are writable (KVCache.reserve).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from prima.ggml_constants import GGMLQuantizationType as Q
from prima.kernels import attention_compiled, drivers, float_weights, ops_compiled
from prima.kernels.ops_reference import QkvSplit

# Float weights' type ids: their rows are read as stored, as unsigned integers of their width, by
# the row-group kernels matmul_many runs for them (drivers.float_matvec).
F32_ID, F16_ID, BF16_ID = int(Q.F32), int(Q.F16), int(Q.BF16)
FLOAT_IDS = (F32_ID, F16_ID, BF16_ID)
# Every format decode_layer computes: the quantized ones' kernels and the float ones'.
DECODE_IDS: frozenset[int] = drivers.QUANTIZED_IDS | frozenset(FLOAT_IDS)


class FusedLayer(NamedTuple):
    """One block's constants as decode_layer takes them: `ws` the seven projections (q, k, v,
    output, gate, up, down) as raw uint8 rows and `fmts` their GGML type ids; `norms` the
    attention, FFN, post-attention and post-FFN norm weights (empty where absent); `qkv` the
    q|k|v split; `gelu_table` ops_reference.gelu_fp16_table() for a GELU model, else empty."""

    ws: tuple[np.ndarray, ...]
    fmts: np.ndarray
    norms: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    qkv: QkvSplit
    attn_scale: float
    window: int  # 0: attends to the whole context
    ffn_dim: int
    gelu: bool
    gelu_table: np.ndarray

    def plain(self) -> tuple:
        """The fields as plain tuples, the form decode_layer takes: numba's dispatcher types a
        plain tuple in C but a NamedTuple in Python, a few microseconds more for each of a
        token's layers."""
        return (*self[:3], tuple(self.qkv), *self[4:])


@njit(cache=True)
def _project(fmt, a, b, c, x, int8, lut):
    """x @ [A; B; C].T of one format, as matmul_many's fused launch (A, B, C raw bytes)."""
    out = np.empty((x.shape[0], a.shape[0] + b.shape[0] + c.shape[0]), dtype=np.float32)
    if fmt == F16_ID:
        drivers.matvec_f16(a.view(np.uint16), b.view(np.uint16), c.view(np.uint16), x, out)
    elif fmt == BF16_ID:
        float_weights.matvec_bf16(a.view(np.uint16), b.view(np.uint16), c.view(np.uint16), x, out)
    elif fmt == F32_ID:
        drivers.matvec_f32(a.view(np.uint32), b.view(np.uint32), c.view(np.uint32), x, out)
    elif int8 and drivers.has_int8(fmt):
        drivers.matvec_q8(fmt, a, b, c, x, out)
    else:
        drivers.matvec(fmt, a, b, c, x, lut, out)
    return out


@njit(cache=True)
def _project3(fa, fb, fc, a, b, c, x, int8, lut):
    """x @ [A; B; C].T where consecutive weights of one format share a launch (WindowedModel's
    grouping of q/k/v and gate/up: A|B|C, A|B + C, A + B|C, or three launches)."""
    n = x.shape[0]
    ra, rb = a.shape[0], b.shape[0]
    if fa == fb and fb == fc:
        return _project(fa, a, b, c, x, int8, lut)
    out = np.empty((n, ra + rb + c.shape[0]), dtype=np.float32)
    if fa == fb:
        out[:, : ra + rb] = _project(fa, a, b, c[:0], x, int8, lut)
        out[:, ra + rb :] = _project(fc, c, c[:0], c[:0], x, int8, lut)
    elif fb == fc:
        out[:, :ra] = _project(fa, a, a[:0], a[:0], x, int8, lut)
        out[:, ra:] = _project(fb, b, c, c[:0], x, int8, lut)
    else:
        out[:, :ra] = _project(fa, a, a[:0], a[:0], x, int8, lut)
        out[:, ra : ra + rb] = _project(fb, b, b[:0], b[:0], x, int8, lut)
        out[:, ra + rb :] = _project(fc, c, c[:0], c[:0], x, int8, lut)
    return out


@njit(cache=True)
def decode_layer(x, layer, kv, t, positions, int8, lut, attn_parallel_min):
    """Hidden states x (n, d) through one block; writes the tokens' keys and values into the
    cache rows at `positions`; t is the number of valid cache rows afterwards."""
    ws, fmts, norms, qkv_fields, scale, window, ffn_dim, gelu, gelu_table = layer
    split = QkvSplit(*qkv_fields)
    attn_norm, ffn_norm, post_attn, post_ffw = norms
    eps = split.eps
    xn = ops_compiled.rms_norm(x, attn_norm, eps)
    qkv = _project3(fmts[0], fmts[1], fmts[2], ws[0], ws[1], ws[2], xn, int8, lut)
    q, k, v = ops_compiled.qkv_rope_rows(qkv, split, positions)
    k32, v32, k16, v16 = kv
    attention_compiled.store_kv(k, v, k32, v32, k16, v16, positions)
    if q.shape[0] * t >= attn_parallel_min:
        attn = attention_compiled._attention_parallel(q, k32, v32, k16, v16, t, positions, scale, window)
    else:
        attn = attention_compiled._attention_serial(q, k32, v32, k16, v16, t, positions, scale, window)
    o = _project(fmts[3], ws[3], ws[3][:0], ws[3][:0], attn, int8, lut)
    x, xn = ops_compiled.residual_norm_rows(x, o, post_attn, ffn_norm, eps)
    gate_up = _project3(fmts[4], fmts[5], fmts[5], ws[4], ws[5], ws[5][:0], xn, int8, lut)
    if gelu:
        act = ops_compiled.gelu_mul(gate_up, ffn_dim, gelu_table)
    else:
        act = ops_compiled.silu_mul(gate_up, ffn_dim)
    ffn = _project(fmts[6], ws[6], ws[6][:0], ws[6][:0], act, int8, lut)
    x, _ = ops_compiled.residual_norm_rows(x, ffn, post_ffw, post_ffw[:0], eps)
    return x
