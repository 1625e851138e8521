"""Q5_0: 32 weights per block, d (f16), qh (the 32 fifth bits as a little-endian u32: bit j
belongs to element j) and 16 bytes of low nibbles (as Q4_0); value = d * ((nibble | high << 4)
- 16)."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.int8_dots import dot_nib16, f16_at, half_at, u32_at
from prima.kernels.lanes import half, lane_sum, nibbles, stack_f32, u32
from prima.kernels.row_groups import legacy_rows

LAYOUT = layouts.Q5_0
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
HALF = QK // 2
D, QH, QS = LAYOUT.offset("d"), LAYOUT.offset("qh"), LAYOUT.offset("qs")


@njit(cache=True)
def dot(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(QK), QK)
    n_blocks = x.shape[1] // QK
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(QK):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * BLOCK
            d = half(lut, row, o + D)
            qh = u32(row, o + QH)
            xb = b * QK
            for j in range(HALF):
                lo, hi = nibbles(row[o + QS + j])
                h0 = np.float32((qh >> np.uint32(j)) & np.uint32(1)) * np.float32(16)
                h1 = np.float32((qh >> np.uint32(j + HALF)) & np.uint32(1)) * np.float32(16)
                v0 = lo + h0 - np.float32(16)
                v1 = hi + h1 - np.float32(16)
                acc[j] += xk[xb + j] * (d * v0)
                acc[j + HALF] += xk[xb + HALF + j] * (d * v1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // QK
    for b in range(n_blocks):
        o = b * BLOCK
        d = half(lut, row, o + D)
        qh = u32(row, o + QH)
        for j in range(HALF):
            q = row[o + QS + j]
            h0 = ((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4)
            h1 = ((qh >> np.uint32(j + HALF)) & np.uint32(1)) << np.uint32(4)
            y[b * QK + j] = d * (np.float32(np.uint32(q & np.uint8(15)) | h0) - np.float32(16))
            y[b * QK + HALF + j] = d * (np.float32(np.uint32(q >> np.uint8(4)) | h1) - np.float32(16))


@njit(cache=True, inline="always")
def _qblock(accp, w, r, wr, b, xq, xd, xs, k, xk):
    o = b * BLOCK
    d = half_at(w, r, o + D)
    dot_nib16(accp, d * xd[k, b], w, wr + o + QS, u32_at(w, r, o + QH), xq, xk + b * QK)
    return np.float32(-16.0) * d * xs[k, b]  # q - 16, the offset through the block sum of x


qdot = njit(cache=True)(legacy_rows(LAYOUT, _qblock))


@njit(cache=True)
def unpack(row: np.ndarray, u: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """row -> 5-bit u, sc = d, mn = -16 d (prima.kernels.int8_gemm)."""
    for b in range(u.shape[0] // QK):
        o = b * BLOCK
        d = f16_at(row, o + D)
        qh = u32(row, o + QH)
        for j in range(HALF):
            q = row[o + QS + j]
            u[b * QK + j] = (q & np.uint8(15)) | np.uint8(
                ((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4)
            )
            u[b * QK + HALF + j] = (q >> np.uint8(4)) | np.uint8(
                ((qh >> np.uint32(j + HALF)) & np.uint32(1)) << np.uint32(4)
            )
        for p in range(2):
            sc[2 * b + p] = d
            mn[2 * b + p] = np.float32(-16.0) * d


FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=31)
