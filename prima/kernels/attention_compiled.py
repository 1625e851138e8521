"""Attention as numba kernels: decode's few query rows attend head by head over the KV cache
(float32, or halves widened as read), in parallel once a launch pays; prefill's many rows run
ops_reference.attention's batched matmuls in row blocks on the prefill threads; and a block's new
keys and values are stored into the cache.

Each mirrors prima.kernels.ops_reference.attention (the tests compare them); the per-head dot
sums in a fixed lane order, so every compiled copy gives the same bits. The rest of the layer
glue is in prima.kernels.ops_compiled.
"""

from __future__ import annotations

import numpy as np
from numba import carray, get_num_threads, njit, prange

from prima.kernels import ops_reference as ops
from prima.kernels.lanes import (
    as_float32,
    exp_f32,
    half_bits,
    holds_halves,
    pairwise_sum32,
    round_to_half,
    stack_f32,
)
from prima.kernels.prefill_attention import prefill_attention
from prima.kernels.thread_env import workers_spin

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


@njit(cache=True, inline="always")
def store_half(x: np.ndarray, out: np.ndarray) -> None:
    """out (heads, hd; uint16 bits) = x rounded to halves as numpy's astype(float16) rounds: a token's keys or
    values into a cache row (prima.weights.kv_cache)."""
    for h in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[h, j] = half_bits(x[h, j])


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


# From this many query rows (prefill) attention runs as prefill_attention's two matmuls (BLAS)
# around a compiled softmax, its row blocks on the prefill threads: at 128 rows 2x (128 keys) to
# 7x (512 keys) faster on one thread than the per-pair kernel, which stays for decode's few rows.
ATTENTION_BATCHED_MIN_ROWS = 8


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
        return prefill_attention(q, k_cache, v_cache, t, positions, scale, window)
    parallel = q.shape[0] * t >= attention_parallel_min(get_num_threads())
    run = _attention_parallel if parallel else _attention_serial
    return run(q, *ops.cache_forms(k_cache, v_cache), t, positions, scale, window)
