"""Q4_1: 32 weights per block, d and m (f16) and 16 bytes of nibbles (as Q4_0);
value = d * q + m."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.int8_dots import dot_nib16, f16_at, half_at
from prima.kernels.lanes import NATIVE_HALF, half, lane_sum, nibbles, stack_f32
from prima.kernels.row_groups import affine_rows, legacy_rows

LAYOUT = layouts.Q4_1
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
HALF = QK // 2
D, M, QS = LAYOUT.offset("d"), LAYOUT.offset("m"), LAYOUT.offset("qs")


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
            m = half(lut, row, o + M)
            xb = b * QK
            for j in range(HALF):
                lo, hi = nibbles(row[o + QS + j])
                acc[j] += xk[xb + j] * (d * lo + m)
                acc[j + HALF] += xk[xb + HALF + j] * (d * hi + m)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // QK
    for b in range(n_blocks):
        o = b * BLOCK
        d = half(lut, row, o + D)
        m = half(lut, row, o + M)
        for j in range(HALF):
            q = row[o + QS + j]
            y[b * QK + j] = d * np.float32(q & np.uint8(15)) + m
            y[b * QK + HALF + j] = d * np.float32(q >> np.uint8(4)) + m


@njit(cache=True, inline="always")
def _qblock(accp, w, r, wr, b, xq, xd, xs, k, xk):
    o = b * BLOCK
    dot_nib16(accp, half_at(w, r, o + D) * xd[k, b], w, wr + o + QS, 0, xq, xk + b * QK)
    return half_at(w, r, o + M) * xs[k, b]


@njit(cache=True, inline="always")
def _block_dot(accp, scale, w, r, wr, o, xq, xk):
    dot_nib16(accp, scale, w, wr + o + QS, 0, xq, xk)


# Four blocks' scales at a time where the CPU converts halves (affine_rows), else block by block.
qdot = njit(cache=True)(affine_rows(LAYOUT, _block_dot) if NATIVE_HALF else legacy_rows(LAYOUT, _qblock))


@njit(cache=True)
def unpack(row: np.ndarray, u: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """row -> nibbles u, sc = d, mn = m (prima.kernels.int8_gemm)."""
    for b in range(u.shape[0] // QK):
        o = b * BLOCK
        d = f16_at(row, o + D)
        m = f16_at(row, o + M)
        for j in range(HALF):
            q = row[o + QS + j]
            u[b * QK + j] = q & np.uint8(15)
            u[b * QK + HALF + j] = q >> np.uint8(4)
        for p in range(2):
            sc[2 * b + p] = d
            mn[2 * b + p] = m


FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=15)
