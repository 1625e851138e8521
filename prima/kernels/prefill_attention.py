"""Attention for many query rows at once (a prompt, or a chat turn over a kept cache): the two
products as BLAS matmuls, and between them one compiled pass for the scale, the causal mask and
the softmax.

A chat turn's new rows meet every position its session holds, so from the second turn on this
is most of a small model's prefill. As numpy steps the pass between the products cost more than
the products themselves (seven sweeps of the scores, temporaries, an exp slow on the
subnormals a long context makes); here each row of scores is read and written in one loop nest
that LLVM vectorizes, and an underflowing weight is 0.

Agrees with prima.kernels.ops_reference.attention to float32 rounding: the exponentials and the
row sums are computed in another order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prima.kernels.lanes import exp_f32, half_to_f32, pairwise_sum32, round_to_half
from prima.kernels.matmul import prefill_map

# Query rows per block: a block's scores (heads x rows x keys) and their temporaries are the
# largest arrays of a prefill's first layer, which sets how far the heap grows, and a chat turn's
# hundred rows split evenly between two threads only in small blocks. Blocks are cut
# from the batch's first row whatever the thread count, and each reads only the keys its own rows
# can see, so a row's bits depend on its block alone: a batch cut into pieces of whole blocks
# attends as the batch does (prima.forward.row_pieces).
BLOCK_ROWS = 16
_LANES = 32  # float32 lanes of a row sum, a fixed order that vectorizes


def prefill_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    t: int,
    positions: np.ndarray,
    scale: float,
    window: int,
) -> np.ndarray:
    """Causal grouped-query attention of q (n, H, hd) at `positions` over cache rows [0, t)
    (float16 or float32, prima.weights.kv_cache), as ops_reference.attention; (n, H * hd). In
    blocks of BLOCK_ROWS query rows, each over the keys its rows can see (a sliding window drops
    the older ones), the blocks split between the prefill threads (kernels.matmul.prefill_map)."""
    base = max(0, int(positions.min()) - window + 1) if window > 0 else 0
    halves = k_cache.dtype == np.float16
    if halves:  # widened once for every block: a conversion, the same bits whichever block reads it
        k, v = widen_halves(k_cache[base:t].view(np.uint16)), widen_halves(v_cache[base:t].view(np.uint16))
    else:
        k, v = k_cache[base:t], v_cache[base:t]
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    n_blocks = (q.shape[0] + BLOCK_ROWS - 1) // BLOCK_ROWS

    def blocks(span: tuple[int, int]) -> None:
        for block in range(*span):
            a = block * BLOCK_ROWS
            b = min(q.shape[0], a + BLOCK_ROWS)
            # Only the keys from the block's first query's window to its last query: masking
            # would zero the rest, and the count of keys a block reads sets the length of its sums.
            lo = max(0, int(positions[a:b].min()) - window + 1) if window > 0 else 0
            seen = int(positions[a:b].max()) + 1
            rel = np.ascontiguousarray(positions[a:b] - lo, dtype=np.int64)
            out[a:b] = _block(
                q[a:b], k[lo - base : seen - base], v[lo - base : seen - base], rel, scale, window, halves
            )

    prefill_map(blocks, n_blocks)
    return out


def _block(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    rel: np.ndarray,
    scale: float,
    window: int,
    halves: bool,
) -> np.ndarray:
    """Query rows q (n, H, hd) at key positions `rel` over float32 keys and values (T, KVH, hd)."""
    n, n_heads, hd = q.shape
    t, n_kv, _ = k.shape
    group = n_heads // n_kv
    # (KVH, group * n, hd) x (KVH, hd, T) -> (KVH, group * n, T): a query head's rows meet its
    # KV head's keys in one product.
    qg = np.array(q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd))
    if halves:  # llama.cpp's product with a half K rounds the queries to halves too
        round_rows_to_halves(qg.reshape(-1, hd))
    scores = np.matmul(qg, k.transpose(1, 2, 0))
    causal_softmax(scores.reshape(n_kv * group, n, t), rel, np.float32(scale), window, halves)
    out = np.matmul(scores, v.transpose(1, 0, 2))  # (KVH, group * n, hd)
    return out.reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3).reshape(n, n_heads * hd)


@njit(cache=True, nogil=True)
def causal_softmax(scores: np.ndarray, rel: np.ndarray, scale: np.float32, window: int, halves: bool) -> None:
    """In place over scores (R, n, T), rows of n queries at key positions rel (n,): scaled; keys
    after the query, or `window` or more behind it, weighted 0; a softmax over the rest, the
    weights rounded to halves where they meet a cache of halves (as llama.cpp's product rounds
    them, and as decode's kernel does)."""
    t = scores.shape[2]
    lanes = np.empty(_LANES, dtype=np.float32)
    for r in range(scores.shape[0]):
        for i in range(scores.shape[1]):
            hi = min(t, rel[i] + 1)
            lo = max(0, rel[i] - window + 1) if window > 0 else 0
            full = scores[r, i]
            full[:lo] = 0.0
            full[hi:] = 0.0
            row = full[lo:hi]
            # Each loop vectorizes: the scale and the row's max in lanes, the exponentials and
            # their sum in lanes (a fixed order), the division.
            m = _scale_and_max(row, scale, lanes)
            total = _exp_and_sum(row, m, lanes)
            if halves:
                for s in range(row.shape[0]):
                    row[s] = round_to_half(row[s] / total)
            else:
                for s in range(row.shape[0]):
                    row[s] = row[s] / total


@njit(cache=True, inline="always")
def _scale_and_max(x: np.ndarray, scale: np.float32, lanes: np.ndarray) -> np.float32:
    """x *= scale in place; the largest of x (lane by lane first: one running max is a chain of
    dependent compares that does not vectorize)."""
    full = x.shape[0] - x.shape[0] % _LANES
    for j in range(_LANES):
        lanes[j] = -np.inf
    for b in range(0, full, _LANES):
        for j in range(_LANES):
            v = x[b + j] * scale
            x[b + j] = v
            lanes[j] = v if v > lanes[j] else lanes[j]
    m = np.float32(-np.inf)
    for j in range(_LANES):
        m = lanes[j] if lanes[j] > m else m
    for s in range(full, x.shape[0]):
        v = x[s] * scale
        x[s] = v
        m = v if v > m else m
    return m


@njit(cache=True, inline="always")
def _exp_and_sum(x: np.ndarray, m: np.float32, lanes: np.ndarray) -> np.float32:
    """x = exp(x - m) in place; their sum in _LANES lanes, then pairwise (a fixed order)."""
    full = x.shape[0] - x.shape[0] % _LANES
    for j in range(_LANES):
        lanes[j] = 0.0
    for b in range(0, full, _LANES):
        for j in range(_LANES):
            e = exp_f32(x[b + j] - m)
            x[b + j] = e
            lanes[j] += e
    total = pairwise_sum32(lanes)
    for s in range(full, x.shape[0]):
        e = exp_f32(x[s] - m)
        x[s] = e
        total += e
    return total


@njit(cache=True, nogil=True)
def widen_halves(bits: np.ndarray) -> np.ndarray:
    """A (T, KVH, hd) slice of a cache of halves (uint16 bits) as float32 (numpy's own
    conversion from float16 does not use the CPU's instruction)."""
    out = np.empty(bits.shape, dtype=np.float32)
    for s in range(bits.shape[0]):
        for h in range(bits.shape[1]):
            for j in range(bits.shape[2]):
                out[s, h, j] = half_to_f32(bits[s, h, j])
    return out


@njit(cache=True, nogil=True)
def round_rows_to_halves(x: np.ndarray) -> None:
    """x (rows, cols; float32) rounded to halves in place, as astype(float16) rounds."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[i, j] = round_to_half(x[i, j])
