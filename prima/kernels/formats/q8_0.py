"""Q8_0: 32 weights per block, d (f16) and 32 int8; value = d * q."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.int8_dots import dot_i8x32, f16_at, half_at
from prima.kernels.lanes import half, lane_sum, stack_f32
from prima.kernels.row_groups import legacy_rows

LAYOUT = layouts.Q8_0
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
D, QS = LAYOUT.offset("d"), LAYOUT.offset("qs")


@njit(cache=True)
def dot(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(QK), QK)
    n_blocks = x.shape[1] // QK
    qs = row.view(np.int8)
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(QK):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * BLOCK
            d = half(lut, row, o + D)
            xb = b * QK
            for j in range(QK):
                acc[j] += xk[xb + j] * (d * np.float32(qs[o + QS + j]))
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // QK
    qs = row.view(np.int8)
    for b in range(n_blocks):
        o = b * BLOCK
        d = half(lut, row, o + D)
        for j in range(QK):
            y[b * QK + j] = d * np.float32(qs[o + QS + j])


@njit(cache=True, inline="always")
def _qblock(accp, w, r, wr, b, xq, xd, xs, k, xk):
    o = b * BLOCK
    dot_i8x32(accp, half_at(w, r, o + D) * xd[k, b], w, wr + o + QS, xq, xk + b * QK)
    return np.float32(0.0)


qdot = njit(cache=True)(legacy_rows(LAYOUT, _qblock))


@njit(cache=True)
def unpack(row: np.ndarray, u: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """row -> u = q + 128 (the int8 quant as an unsigned byte), sc = d, mn = -128 d
    (prima.kernels.int8_gemm)."""
    for b in range(u.shape[0] // QK):
        o = b * BLOCK
        d = f16_at(row, o + D)
        for j in range(QK):
            u[b * QK + j] = row[o + QS + j] ^ np.uint8(128)
        for p in range(2):
            sc[2 * b + p] = d
            mn[2 * b + p] = np.float32(-128.0) * d


FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=255)
