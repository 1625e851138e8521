"""Q4_K: 256 weights per super-block: d and dmin (f16), scales[12] (8 sub-blocks of 32, each a
6-bit scale and min, see scale_min), qs[128] (nibbles). Byte g*32 + j holds element g*64 + j
(low nibble, sub-block 2g) and element g*64 + 32 + j (high nibble, sub-block 2g + 1);
value = (d * scale) * q - dmin * min."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.int8_dots import QK8, dot_hi32, dot_lo32, f16_at, half_at
from prima.kernels.lanes import half, lane_sum, nibbles, stack_f32
from prima.kernels.row_groups import superblock_rows

LAYOUT = layouts.Q4_K
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
D, DMIN, SCALES, QS = (LAYOUT.offset(f) for f in ("d", "dmin", "scales", "qs"))
XB = QK // QK8  # activation blocks per super-block


@njit(cache=True, inline="always")
def scale_min(row: np.ndarray, o: int, j: int) -> tuple[np.float32, np.float32]:
    """Scale and min of sub-block j (0-7) from the 12 packed bytes at `o` (also Q5_K's): bytes
    0-3 hold 6-bit scales 0-3, bytes 4-7 mins 0-3 (top 2 bits of each extend scales/mins 4-7),
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    if j < 4:
        sc = row[o + j] & 63
        m = row[o + j + 4] & 63
    else:
        sc = (row[o + j + 4] & 15) | ((row[o + j - 4] >> 6) << 4)
        m = (row[o + j + 4] >> 4) | ((row[o + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


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
                    lo, hi = nibbles(row[qo + j])
                    acc[j] += xk[xb + j] * (d0 * lo - dm0) + xk[xb + 32 + j] * (d1 * hi - dm1)
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
                y[yb + j] = (d * sc0) * np.float32(q & np.uint8(15)) - dmin * m0
                y[yb + 32 + j] = (d * sc1) * np.float32(q >> np.uint8(4)) - dmin * m1


@njit(cache=True, inline="always")
def scale_min_at(w: np.ndarray, r: int, o: int, j: int) -> tuple[np.float32, np.float32]:
    """scale_min for byte `o` of row r of the 2-D `w` (the int8 kernel's addressing)."""
    if j < 4:
        sc = np.int32(w[r, o + j] & 63)
        m = np.int32(w[r, o + j + 4] & 63)
    else:
        sc = np.int32((w[r, o + j + 4] & 15) | ((w[r, o + j - 4] >> 6) << 4))
        m = np.int32((w[r, o + j + 4] >> 4) | ((w[r, o + j] >> 6) << 4))
    return np.float32(sc), np.float32(m)


@njit(cache=True, inline="always")
def _superblock(acc0p, acc1p, w, r, wr, sb, xq, xd, xs, k, xk, mins):
    """Super-block sb of row r against activation row k: its eight sub-blocks' dots added to
    acc0p (even) and acc1p (odd); returns `mins` plus its terms dmin * min * (block sum of x),
    added one by one (the row's running sum)."""
    o = sb * BLOCK
    d = half_at(w, r, o + D)
    dmin = half_at(w, r, o + DMIN)
    for g in range(4):
        sc0, m0 = scale_min_at(w, r, o + SCALES, 2 * g)
        sc1, m1 = scale_min_at(w, r, o + SCALES, 2 * g + 1)
        b = sb * XB + 2 * g
        qo = wr + o + QS + g * 32
        dot_lo32(acc0p, d * sc0 * xd[k, b], w, qo, xq, xk + b * QK8)
        dot_hi32(acc1p, d * sc1 * xd[k, b + 1], w, qo, xq, xk + b * QK8 + QK8)
        mins += dmin * (m0 * xs[k, b] + m1 * xs[k, b + 1])
    return mins


# Sub-block 2g meets activation block b, 2g + 1 block b + 1, and the mins meet the blocks' sums.
qdot = njit(cache=True)(superblock_rows(LAYOUT, _superblock, prefetched=False))


@njit(cache=True)
def unpack(row: np.ndarray, u: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """row -> nibbles u, sc = d * scale and mn = -(dmin * min) of each sub-block (for both of
    its 16-element pieces; prima.kernels.int8_gemm)."""
    for sb in range(u.shape[0] // QK):
        o = sb * BLOCK
        d = f16_at(row, o + D)
        dmin = f16_at(row, o + DMIN)
        for g in range(4):
            ub = sb * QK + g * 64
            for j in range(32):
                q = row[o + QS + g * 32 + j]
                u[ub + j] = q & np.uint8(15)
                u[ub + 32 + j] = q >> np.uint8(4)
            for h in range(2):
                sc_, m = scale_min(row, o + SCALES, 2 * g + h)
                p = (sb * QK + g * 64 + h * 32) // 16
                sc[p] = d * sc_
                sc[p + 1] = d * sc_
                mn[p] = -(dmin * m)
                mn[p + 1] = -(dmin * m)


FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=15)
