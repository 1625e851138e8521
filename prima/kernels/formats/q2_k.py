"""Q2_K: 256 weights per super-block: scales[16] (one byte per 16 elements: low nibble scale,
high nibble min), qs[64] (2-bit values), d and dmin (f16). Element h*128 + s*32 + j (h < 2,
s < 4, j < 32) is bits 2s of qs[h*32 + j]; its scale byte is element // 16;
value = (d * scale) * q - dmin * min. No int8 kernel: q8 mode runs the exact one."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.lanes import half, lane_sum, stack_f32

LAYOUT = layouts.Q2_K
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
SCALES, QS, D, DMIN = (LAYOUT.offset(f) for f in ("scales", "qs", "d", "dmin"))


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
            for h in range(2):
                for s in range(4):
                    sc0 = row[o + SCALES + h * 8 + s * 2]
                    sc1 = row[o + SCALES + h * 8 + s * 2 + 1]
                    dl0 = d * np.float32(sc0 & 15)
                    ml0 = dmin * np.float32(sc0 >> 4)
                    dl1 = d * np.float32(sc1 & 15)
                    ml1 = dmin * np.float32(sc1 >> 4)
                    xb = sb * QK + h * 128 + s * 32
                    qo = o + QS + h * 32
                    for j in range(16):
                        q = (row[qo + j] >> np.uint8(2 * s)) & np.uint8(3)
                        acc[j] += xk[xb + j] * (dl0 * np.float32(q) - ml0)
                    for j in range(16):
                        q = (row[qo + 16 + j] >> np.uint8(2 * s)) & np.uint8(3)
                        acc[16 + j] += xk[xb + 16 + j] * (dl1 * np.float32(q) - ml1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * BLOCK
        d = half(lut, row, o + D)
        dmin = half(lut, row, o + DMIN)
        for h in range(2):
            for s in range(4):
                yb = sb * QK + h * 128 + s * 32
                for j in range(32):
                    sc = row[o + SCALES + h * 8 + s * 2 + (j >> 4)]
                    q = (row[o + QS + h * 32 + j] >> np.uint8(2 * s)) & np.uint8(3)
                    y[yb + j] = (d * np.float32(sc & 15)) * np.float32(q) - dmin * np.float32(sc >> 4)


FORMAT = QuantFormat(LAYOUT, dot, deq)
