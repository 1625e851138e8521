"""Parallel numba drivers over the per-row kernels of the formats (prima.kernels.formats).

The weight format is a runtime argument (its GGML type id), so one compiled driver serves every
format and one parallel launch can cover several weights of the same format (attn_q, attn_k and
attn_v, or ffn_gate and ffn_up): at decode, launches and Python calls cost as much as the math.

  matvec(fmt, a, b, c, x, lut, out)        out (n, ra + rb + rc) = x @ [A; B; C].T
  matvec_q8(fmt, a, b, c, x, out)          the same with x quantized to int8 blocks (int8_dots)
  dequantize_rows(fmt, a, ids, lut, out)   out (m, cols) = A[ids], parallel over ids
  dequantize_tile(fmt, a, start, lut, out) out (m, cols) = A[start : start + m], one thread, no GIL
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from prima.kernels import int8_dots as i8
from prima.kernels.formats import q2_k, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0

Q = GGMLQuantizationType

# GGML type ids, as plain ints for numba.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(Q.Q4_0), int(Q.Q4_1), int(Q.Q5_0), int(Q.Q5_1), int(Q.Q8_0)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(Q.Q2_K), int(Q.Q3_K), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
QUANTIZED_IDS: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
# Formats with an int8-activation kernel (the others run the exact float kernels in q8 mode).
INT8_IDS: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K})

quantize_rows = i8.quantize_rows

# Rows per parallel work item: fewer scheduling steps, still enough items to balance 2-8 threads.
CHUNK_ROWS = 16


@njit(cache=True)
def _dot(fmt: int, row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    if fmt == Q4_0:
        q4_0.dot(row, x, lut, out, r)
    elif fmt == Q4_1:
        q4_1.dot(row, x, lut, out, r)
    elif fmt == Q5_0:
        q5_0.dot(row, x, lut, out, r)
    elif fmt == Q5_1:
        q5_1.dot(row, x, lut, out, r)
    elif fmt == Q8_0:
        q8_0.dot(row, x, lut, out, r)
    elif fmt == Q2_K:
        q2_k.dot(row, x, lut, out, r)
    elif fmt == Q3_K:
        q3_k.dot(row, x, lut, out, r)
    elif fmt == Q4_K:
        q4_k.dot(row, x, lut, out, r)
    elif fmt == Q5_K:
        q5_k.dot(row, x, lut, out, r)
    else:
        q6_k.dot(row, x, lut, out, r)


@njit(cache=True)
def _qdot_rows(
    fmt: int,
    w: np.ndarray,
    r0: int,
    r1: int,
    xq: np.ndarray,
    xd: np.ndarray,
    xs: np.ndarray,
    out: np.ndarray,
    c0: int,
) -> None:
    if fmt == Q8_0:
        q8_0.qdot(w, r0, r1, xq, xd, xs, out, c0)
    elif fmt == Q4_1:
        q4_1.qdot(w, r0, r1, xq, xd, xs, out, c0)
    elif fmt == Q5_0:
        q5_0.qdot(w, r0, r1, xq, xd, xs, out, c0)
    elif fmt == Q4_K:
        q4_k.qdot(w, r0, r1, xq, xd, xs, out, c0)
    elif fmt == Q6_K:
        q6_k.qdot(w, r0, r1, xq, xd, xs, out, c0)
    elif fmt == Q4_0:
        q4_0.qdot(w, r0, r1, xq, xd, xs, out, c0)
    else:
        q5_1.qdot(w, r0, r1, xq, xd, xs, out, c0)


@njit(cache=True)
def _deq(fmt: int, row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    if fmt == Q4_0:
        q4_0.deq(row, lut, y)
    elif fmt == Q4_1:
        q4_1.deq(row, lut, y)
    elif fmt == Q5_0:
        q5_0.deq(row, lut, y)
    elif fmt == Q5_1:
        q5_1.deq(row, lut, y)
    elif fmt == Q8_0:
        q8_0.deq(row, lut, y)
    elif fmt == Q2_K:
        q2_k.deq(row, lut, y)
    elif fmt == Q3_K:
        q3_k.deq(row, lut, y)
    elif fmt == Q4_K:
        q4_k.deq(row, lut, y)
    elif fmt == Q5_K:
        q5_k.deq(row, lut, y)
    else:
        q6_k.deq(row, lut, y)


@njit(parallel=True, cache=True)
def matvec(
    fmt: int, a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray
) -> None:
    """out (n, ra + rb + rc) = x @ [A; B; C].T for raw weights A, B, C of format `fmt` sharing
    the input dimension (pass empty row slices for unused slots)."""
    ra = a.shape[0]
    rab = ra + b.shape[0]
    total = rab + c.shape[0]
    n_chunks = (total + CHUNK_ROWS - 1) // CHUNK_ROWS
    for ch in prange(n_chunks):
        for r in range(ch * CHUNK_ROWS, min(total, (ch + 1) * CHUNK_ROWS)):
            if r < ra:
                _dot(fmt, a[r], x, lut, out, r)
            elif r < rab:
                _dot(fmt, b[r - ra], x, lut, out, r)
            else:
                _dot(fmt, c[r - rab], x, lut, out, r)


@njit(parallel=True, cache=True)
def matvec_q8(fmt: int, a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """matvec for a format in INT8_IDS with x quantized to int8 blocks first (int8_dots): the
    quantization runs here, in the same call, because at decode a call costs as much as the math."""
    n, cols = x.shape
    xq = np.empty((n, cols), dtype=np.int8)
    xd = np.empty((n, cols // 32), dtype=np.float32)
    xs = np.empty((n, cols // 32), dtype=np.float32)
    i8.quantize_rows(x, xq, xd, xs)
    ra = a.shape[0]
    rab = ra + b.shape[0]
    total = rab + c.shape[0]
    n_chunks = (total + CHUNK_ROWS - 1) // CHUNK_ROWS
    for ch in prange(n_chunks):
        start = ch * CHUNK_ROWS
        stop = min(total, start + CHUNK_ROWS)
        # The chunk's rows, split where it crosses from A to B or B to C.
        if start < ra:
            _qdot_rows(fmt, a, start, min(stop, ra), xq, xd, xs, out, start)
        if start < rab and stop > ra:
            lo = max(start, ra)
            _qdot_rows(fmt, b, lo - ra, min(stop, rab) - ra, xq, xd, xs, out, lo)
        if stop > rab:
            lo = max(start, rab)
            _qdot_rows(fmt, c, lo - rab, stop - rab, xq, xd, xs, out, lo)


@njit(parallel=True, cache=True)
def dequantize_rows(fmt: int, a: np.ndarray, ids: np.ndarray, lut: np.ndarray, out: np.ndarray) -> None:
    """out (m, cols) = rows `ids` of A dequantized."""
    for i in prange(ids.shape[0]):
        _deq(fmt, a[ids[i]], lut, out[i])


@njit(cache=True, nogil=True)
def dequantize_tile(fmt: int, a: np.ndarray, start: int, lut: np.ndarray, out: np.ndarray) -> None:
    """out (m, cols) = rows [start, start + m) of A dequantized, on the calling thread without
    the GIL (prefill runs one such tile per Python worker thread, next to a BLAS call)."""
    for i in range(out.shape[0]):
        _deq(fmt, a[start + i], lut, out[i])
