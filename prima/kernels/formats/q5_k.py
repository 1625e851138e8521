"""Q5_K: 256 weights per super-block: d and dmin (f16), scales[12] (as Q4_K), qh[32], qs[128]
(nibbles as Q4_K). Element g*64 + j takes bit 2g of qh[j] as its fifth bit, element
g*64 + 32 + j bit 2g + 1; value = (d * scale) * q - dmin * min."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.formats.q4_k import scale_min, scale_min_at
from prima.kernels.int8_dots import QK8, dot5_hi32, dot5_lo32, f16_at, half_at
from prima.kernels.lanes import half, lane_sum, stack_f32
from prima.kernels.row_groups import superblock_rows

LAYOUT = layouts.Q5_K
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
D, DMIN, SCALES, QH, QS = (LAYOUT.offset(f) for f in ("d", "dmin", "scales", "qh", "qs"))
XB = QK // QK8  # activation blocks per super-block


@njit(cache=True)
def dot(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * BLOCK
            d = half(lut, row, o + D)
            dmin = half(lut, row, o + DMIN)
            for g in range(4):
                sc0, m0 = scale_min(row, o + SCALES, 2 * g)
                sc1, m1 = scale_min(row, o + SCALES, 2 * g + 1)
                d0 = d * sc0
                d1 = d * sc1
                dm0 = dmin * m0
                dm1 = dmin * m1
                xb = sb * QK + g * 64
                qo = o + QS + g * 32
                for j in range(32):
                    hb = ((row[o + QH + j] >> np.uint8(2 * g)) & np.uint8(1)) << np.uint8(4)
                    q = (row[qo + j] & np.uint8(15)) | hb
                    acc[j] += xk[xb + j] * (d0 * np.float32(q) - dm0)
                for j in range(32):
                    hb = ((row[o + QH + j] >> np.uint8(2 * g + 1)) & np.uint8(1)) << np.uint8(4)
                    q = (row[qo + j] >> np.uint8(4)) | hb
                    acc[j] += xk[xb + 32 + j] * (d1 * np.float32(q) - dm1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * BLOCK
        d = half(lut, row, o + D)
        dmin = half(lut, row, o + DMIN)
        for g in range(4):
            sc0, m0 = scale_min(row, o + SCALES, 2 * g)
            sc1, m1 = scale_min(row, o + SCALES, 2 * g + 1)
            yb = sb * QK + g * 64
            for j in range(32):
                q = row[o + QS + g * 32 + j]
                qh = row[o + QH + j]
                lo = (q & np.uint8(15)) | (((qh >> np.uint8(2 * g)) & np.uint8(1)) << np.uint8(4))
                hi = (q >> np.uint8(4)) | (((qh >> np.uint8(2 * g + 1)) & np.uint8(1)) << np.uint8(4))
                y[yb + j] = (d * sc0) * np.float32(lo) - dmin * m0
                y[yb + 32 + j] = (d * sc1) * np.float32(hi) - dmin * m1


@njit(cache=True)
def unpack(row: np.ndarray, u: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """row -> 5-bit u, sc = d * scale and mn = -(dmin * min) of each sub-block (for both of its
    16-element pieces; prima.kernels.int8_gemm)."""
    for sb in range(u.shape[0] // QK):
        o = sb * BLOCK
        d = f16_at(row, o + D)
        dmin = f16_at(row, o + DMIN)
        for g in range(4):
            ub = sb * QK + g * 64
            for j in range(32):
                q = row[o + QS + g * 32 + j]
                qh = row[o + QH + j]
                u[ub + j] = (q & np.uint8(15)) | (((qh >> np.uint8(2 * g)) & np.uint8(1)) << np.uint8(4))
                u[ub + 32 + j] = (q >> np.uint8(4)) | (
                    ((qh >> np.uint8(2 * g + 1)) & np.uint8(1)) << np.uint8(4)
                )
            for h in range(2):
                sc_, m = scale_min(row, o + SCALES, 2 * g + h)
                p = (sb * QK + g * 64 + h * 32) // 16
                sc[p] = d * sc_
                sc[p + 1] = d * sc_
                mn[p] = -(dmin * m)
                mn[p + 1] = -(dmin * m)


@njit(cache=True, inline="always")
def _superblock(acc0p, acc1p, w, r, wr, sb, xq, xd, xs, k, xk, mins):
    """Super-block sb of row r against activation row k, as Q4_K's with the fifth bits: its
    eight sub-blocks' dots added to acc0p (even) and acc1p (odd); returns `mins` plus its mins'
    terms."""
    o = sb * BLOCK
    d = half_at(w, r, o + D)
    dmin = half_at(w, r, o + DMIN)
    for g in range(4):
        sc0, m0 = scale_min_at(w, r, o + SCALES, 2 * g)
        sc1, m1 = scale_min_at(w, r, o + SCALES, 2 * g + 1)
        b = sb * XB + 2 * g
        qo = wr + o + QS + g * 32
        dot5_lo32(acc0p, d * sc0 * xd[k, b], w, qo, wr + o + QH, 2 * g, xq, xk + b * QK8)
        dot5_hi32(acc1p, d * sc1 * xd[k, b + 1], w, qo, wr + o + QH, 2 * g + 1, xq, xk + b * QK8 + QK8)
        mins += dmin * (m0 * xs[k, b] + m1 * xs[k, b + 1])
    return mins


qdot = njit(cache=True)(superblock_rows(LAYOUT, _superblock, prefetched=False))


FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=31)
