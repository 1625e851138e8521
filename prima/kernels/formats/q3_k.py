"""Q3_K: 256 weights per super-block: hmask[32] (high bits), qs[64] (low 2 bits), scales[12]
(16 packed 6-bit scales, see _scale), d (f16). Element h*128 + s*32 + j takes bits 2s of
qs[h*32 + j] and bit 4h + s of hmask[j]; a clear high bit means "subtract 4";
value = (d * (scale - 32)) * q. No int8 kernel: q8 mode runs the exact one."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.lanes import half, lane_sum, stack_f32

LAYOUT = layouts.Q3_K
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
HMASK, QS, SCALES, D = (LAYOUT.offset(f) for f in ("hmask", "qs", "scales", "d"))


@njit(cache=True, inline="always")
def _scale(row: np.ndarray, o: int, k: int) -> np.float32:
    """6-bit scale k (0-15) from the 12 scale bytes at `o`, minus 32: the low 4 bits are
    nibble k // 8 of byte k % 8, the high 2 bits are bits 2 * (k // 4) of byte 8 + k % 4."""
    lo = (row[o + (k & 7)] >> (4 * (k >> 3))) & 15
    hi = (row[o + 8 + (k & 3)] >> (2 * (k >> 2))) & 3
    return np.float32(np.int32(lo | (hi << 4)) - 32)


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
            for h in range(2):
                for s in range(4):
                    dl0 = d * _scale(row, o + SCALES, h * 8 + s * 2)
                    dl1 = d * _scale(row, o + SCALES, h * 8 + s * 2 + 1)
                    xb = sb * QK + h * 128 + s * 32
                    qo = o + QS + h * 32
                    for j in range(16):
                        q = (row[qo + j] >> np.uint8(2 * s)) & np.uint8(3)
                        hb = ((row[o + HMASK + j] >> np.uint8(4 * h + s)) & np.uint8(1)) << np.uint8(2)
                        acc[j] += xk[xb + j] * (dl0 * (np.float32(q | hb) - np.float32(4)))
                    for j in range(16):
                        q = (row[qo + 16 + j] >> np.uint8(2 * s)) & np.uint8(3)
                        hb = ((row[o + HMASK + 16 + j] >> np.uint8(4 * h + s)) & np.uint8(1)) << np.uint8(2)
                        acc[16 + j] += xk[xb + 16 + j] * (dl1 * (np.float32(q | hb) - np.float32(4)))
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * BLOCK
        d = half(lut, row, o + D)
        for h in range(2):
            for s in range(4):
                yb = sb * QK + h * 128 + s * 32
                for j in range(32):
                    dl = d * _scale(row, o + SCALES, h * 8 + s * 2 + (j >> 4))
                    q = (row[o + QS + h * 32 + j] >> np.uint8(2 * s)) & np.uint8(3)
                    hb = ((row[o + HMASK + j] >> np.uint8(4 * h + s)) & np.uint8(1)) << np.uint8(2)
                    y[yb + j] = dl * (np.float32(q | hb) - np.float32(4))


FORMAT = QuantFormat(LAYOUT, dot, deq)
