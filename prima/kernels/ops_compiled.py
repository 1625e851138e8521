"""The per-layer glue of the forward pass as numba kernels: each replaces a chain of numpy calls
whose dispatch overhead, at decode (one token), costs more than the arithmetic.

Each mirrors a float32 reference in prima.kernels.ops_reference (the tests compare them); reductions may
be summed in another order, so results agree to float32 rounding, not bit for bit. Optional
weights are passed as empty arrays so that one compiled variant serves every architecture.
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, get_num_threads, njit, prange

from prima.kernels import ops_reference as ops
from prima.kernels.lanes import (
    as_float32,
    exp_f32,
    half_bits,
    half_to_f32,
    holds_halves,
    pairwise_sum32,
    round_to_half,
    stack_f32,
)
from prima.kernels.matmul import prefill_map
from prima.kernels.ops_reference import ROPE_NEOX, QkvSplit
from prima.kernels.thread_env import workers_spin

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


SCORE_LANES = 32  # float32 lanes of one q.k dot (head dims are multiples of 32 but for a tail)


@njit(cache=True, inline="always")
def _score(qh: np.ndarray, kr: np.ndarray, sc: np.float32, lanes: np.ndarray) -> np.float32:
    """sc * (qh . kr) in float32: SCORE_LANES lane sums (a fixed order, so every compiled copy
    gives the same bits) added pairwise. The scale multiplies each key element, which is what
    lets LLVM vectorize the lanes here (written as a plain product of two loads it kept them
    scalar); a single running sum would be one long chain of dependent adds."""
    hd = qh.shape[0]
    full = hd - hd % SCORE_LANES
    for j in range(SCORE_LANES):
        lanes[j] = 0.0
    for b in range(0, full, SCORE_LANES):
        for j in range(SCORE_LANES):
            lanes[j] += qh[b + j] * (sc * as_float32(kr[b + j]))
    total = pairwise_sum32(lanes)
    for j in range(full, hd):
        total += qh[j] * (sc * as_float32(kr[j]))
    return total


@njit(cache=True, inline="always")
def _attend(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    t: int,
    positions: np.ndarray,
    scale: float,
    window: int,
    item: int,
    out: np.ndarray,
) -> None:
    """Attention of one (token, head) pair `item` = token * H + head, written into out; the
    cache holds float32 or halves (uint16 bits, prima.weights.kv_cache), widened as read."""
    n_heads, hd = q.shape[1], q.shape[2]
    i = item // n_heads
    h = item % n_heads
    kvh = h // (n_heads // k_cache.shape[1])
    pos = positions[i]
    lo = max(0, pos - window + 1) if window > 0 else 0
    hi = min(t, pos + 1)
    scores = np.empty(hi - lo, dtype=np.float32)
    lanes = carray(stack_f32(SCORE_LANES), SCORE_LANES)
    qh = q[i, h]
    halves = holds_halves(k_cache)
    if halves:  # the query meets halves as llama.cpp's: rounded to a half itself (ops.attention)
        qh = np.empty(hd, dtype=np.float32)
        for j in range(hd):
            qh[j] = round_to_half(q[i, h, j])
    sc = np.float32(scale)
    m = np.float32(-np.inf)
    for s in range(lo, hi):
        acc = _score(qh, k_cache[s, kvh], sc, lanes)
        scores[s - lo] = acc
        m = max(m, acc)
    for s in range(hi - lo):
        scores[s] = exp_f32(scores[s] - m)
    total = np.float32(0.0)
    for s in range(hi - lo):
        total += scores[s]
    o = out[i, h * hd : (h + 1) * hd]
    o[:] = 0.0
    for s in range(lo, hi):
        p = scores[s - lo] / total
        if halves:  # as llama.cpp's weights meet a half V: rounded to halves (ops.attention)
            p = round_to_half(p)
        vr = v_cache[s, kvh]
        for j in range(hd):
            o[j] += p * as_float32(vr[j])


@njit(parallel=True, cache=True)
def _attention_parallel(q, k32, v32, k16, v16, t, positions, scale, window):
    """Attention of q over a float32 cache (k32, v32) or, when k16 is not empty, a cache of
    halves (k16, v16: uint16 bits), heads split over the threads."""
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    for item in prange(q.shape[0] * q.shape[1]):
        if k16.shape[0]:
            _attend(q, k16, v16, t, positions, scale, window, item, out)
        else:
            _attend(q, k32, v32, t, positions, scale, window, item, out)
    return out


@njit(cache=True)
def _attention_serial(q, k32, v32, k16, v16, t, positions, scale, window):
    """_attention_parallel on the calling thread (the same bits)."""
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    for item in range(q.shape[0] * q.shape[1]):
        if k16.shape[0]:
            _attend(q, k16, v16, t, positions, scale, window, item, out)
        else:
            _attend(q, k32, v32, t, positions, scale, window, item, out)
    return out


@njit(cache=True)
def store_kv(k, v, k32, v32, k16, v16, positions):
    """A block's new keys and values k, v (n, KVH, hd) into cache rows `positions`: the float32
    cache, or, when k16 is not empty, the cache of halves (rounded as numpy's astype rounds)."""
    for i in range(positions.shape[0]):
        p = positions[i]
        if k16.shape[0]:
            store_half(k[i], k16[p])
            store_half(v[i], v16[p])
        else:
            k32[p] = k[i]
            v32[p] = v[i]


# Decode attention runs its heads in parallel from this many (query row, key) pairs: below, a
# launch costs more than it saves, and a launch costs what waking the workers costs, far more
# when they sleep than when they spin (measured in docs/performance.md, "What the numbers rest
# on").
ATTENTION_PARALLEL_MIN_SPINNING = 48
ATTENTION_PARALLEL_MIN_SLEEPING = 1024
NEVER = 1 << 62


def attention_parallel_min(threads: int) -> int:
    """The (query row, key) pairs from which decode attention goes parallel, for `threads`
    workers waiting as the environment tells them to (prima.kernels.thread_env)."""
    if threads <= 1:
        return NEVER
    return ATTENTION_PARALLEL_MIN_SPINNING if workers_spin() else ATTENTION_PARALLEL_MIN_SLEEPING


# From this many query rows (prefill) attention runs as ops.attention's batched matmuls (BLAS),
# its row blocks on the prefill threads: at 128 rows 2x (128 keys) to 7x (512 keys) faster on one
# thread than the per-pair kernel, which stays for decode's few rows.
ATTENTION_BATCHED_MIN_ROWS = 8
# Query rows per batched call: its scores (heads x rows x keys) and their temporaries are the
# largest arrays of a prefill's first layer, which sets how far the heap grows (SmolLM2, 128
# rows on 2 threads: 2.2 MiB of peak RSS in one call per thread, ~1 MiB less in blocks of 32).
# Blocks are cut from the batch's first row whatever the thread count, and each reads only the
# keys its own rows can see, so a row's bits depend on its block alone: a batch cut into pieces
# of whole blocks attends as the batch does (prima.forward.row_pieces).
ATTENTION_BLOCK_ROWS = 32


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    t: int,
    positions: np.ndarray,
    scale: float,
    window: int,
) -> np.ndarray:
    """Causal grouped-query attention of q (n, H, hd) over cache rows [0, t) (float16 or float32,
    prima.weights.kv_cache), as ops.attention. Returns (n, H * hd). Parallel over (token, head)
    pairs when the work is large enough."""
    if q.shape[0] >= ATTENTION_BATCHED_MIN_ROWS:
        return _attention_batched(q, k_cache, v_cache, t, positions, scale, window)
    parallel = q.shape[0] * t >= attention_parallel_min(get_num_threads())
    run = _attention_parallel if parallel else _attention_serial
    return run(q, *ops.cache_forms(k_cache, v_cache), t, positions, scale, window)


@njit(cache=True, nogil=True)
def widen_halves(bits: np.ndarray) -> np.ndarray:
    """A (T, KVH, hd) slice of a cache of halves (uint16 bits) as float32, for prefill's batched
    attention (numpy's own conversion from float16 does not use the CPU's instruction)."""
    out = np.empty(bits.shape, dtype=np.float32)
    for s in range(bits.shape[0]):
        for h in range(bits.shape[1]):
            for j in range(bits.shape[2]):
                out[s, h, j] = half_to_f32(bits[s, h, j])
    return out


@njit(cache=True, nogil=True)
def _round_rows_to_halves(x: np.ndarray) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[i, j] = round_to_half(x[i, j])


def round_to_halves(x: np.ndarray) -> np.ndarray:
    """x (C-contiguous float32) rounded to halves in place, as astype(float16) rounds; returns x."""
    _round_rows_to_halves(x.reshape(-1, x.shape[-1]))
    return x


def _attention_batched(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    t: int,
    positions: np.ndarray,
    scale: float,
    window: int,
) -> np.ndarray:
    """ops.attention in blocks of ATTENTION_BLOCK_ROWS query rows, each over the keys its rows
    can see (a sliding window drops the older ones), the blocks split between the prefill
    threads (kernels.matmul.prefill_map)."""
    base = max(0, int(positions.min()) - window + 1) if window > 0 else 0
    halves = k_cache.dtype == np.float16
    if halves:  # widened once for every block: a conversion, the same bits whichever block reads it
        k, v = widen_halves(k_cache[base:t].view(np.uint16)), widen_halves(v_cache[base:t].view(np.uint16))
    else:
        k, v = k_cache[base:t], v_cache[base:t]
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    n_blocks = (q.shape[0] + ATTENTION_BLOCK_ROWS - 1) // ATTENTION_BLOCK_ROWS

    def blocks(span: tuple[int, int]) -> None:
        for block in range(*span):
            a = block * ATTENTION_BLOCK_ROWS
            b = min(q.shape[0], a + ATTENTION_BLOCK_ROWS)
            # Only the keys from the block's first query's window to its last query: masking
            # would zero the rest (at 128 rows in blocks of 32, 37% of the products), and the
            # count of keys a block reads sets the length of its sums.
            lo = max(0, int(positions[a:b].min()) - window + 1) if window > 0 else 0
            seen = int(positions[a:b].max()) + 1
            out[a:b] = ops.attention(
                q[a:b],
                k[lo - base : seen - base],
                v[lo - base : seen - base],
                positions[a:b] - lo,
                scale,
                window,
                halves,
                round_to_halves,
            )

    prefill_map(blocks, n_blocks)
    return out


@njit(cache=True, inline="always")
def _silu_row(gate_up: np.ndarray, ffn_dim: int, out: np.ndarray, i: int) -> None:
    """Row i: the exponentials in a loop of their own, which vectorizes (fused into the product
    it did not: 14 against 3 us for SmolLM2's 1536)."""
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
def store_half(x: np.ndarray, out: np.ndarray) -> None:
    """out (heads, hd; uint16 bits) = x rounded to halves as numpy's astype(float16) rounds: a token's keys or
    values into a cache row (prima.weights.kv_cache)."""
    for h in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[h, j] = half_bits(x[h, j])


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
