"""Q6_K: 256 weights per super-block: ql[128] (low nibbles), qh[64] (2 high bits), scales[16]
(int8, one per 16 elements), d (f16); value = d * scale * (q - 32). Within half h (128
elements), chunk c (32 elements) takes nibble c // 2 of ql[64h + 32 (c % 2) + j] and bits 2c
of qh[32h + j]."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import QuantFormat, layouts
from prima.kernels.int8_dots import QK8, dot_q6x32, f16_at, half_at
from prima.kernels.lanes import half, lane_sum, stack_f32
from prima.kernels.row_groups import superblock_rows

LAYOUT = layouts.Q6_K
QK, BLOCK = LAYOUT.elements, LAYOUT.nbytes
QL, QH, SCALES, D = (LAYOUT.offset(f) for f in ("ql", "qh", "scales", "d"))
XB = QK // QK8  # activation blocks per super-block


@njit(cache=True)
def dot(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    scales = row.view(np.int8)
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * BLOCK
            d = half(lut, row, o + D)
            for h in range(2):
                for c in range(4):
                    dl0 = d * np.float32(scales[o + SCALES + h * 8 + c * 2])
                    dl1 = d * np.float32(scales[o + SCALES + h * 8 + c * 2 + 1])
                    lo = o + QL + h * 64 + (c & 1) * 32
                    ho = o + QH + h * 32
                    xb = sb * QK + h * 128 + c * 32
                    for j in range(16):
                        q = ((row[lo + j] >> np.uint8(4 * (c >> 1))) & np.uint8(15)) | (
                            ((row[ho + j] >> np.uint8(2 * c)) & np.uint8(3)) << np.uint8(4)
                        )
                        acc[j] += xk[xb + j] * (dl0 * (np.float32(q) - np.float32(32)))
                    for j in range(16):
                        q = ((row[lo + 16 + j] >> np.uint8(4 * (c >> 1))) & np.uint8(15)) | (
                            ((row[ho + 16 + j] >> np.uint8(2 * c)) & np.uint8(3)) << np.uint8(4)
                        )
                        acc[16 + j] += xk[xb + 16 + j] * (dl1 * (np.float32(q) - np.float32(32)))
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    scales = row.view(np.int8)
    for sb in range(n_super):
        o = sb * BLOCK
        d = half(lut, row, o + D)
        for h in range(2):
            for c in range(4):
                lo = o + QL + h * 64 + (c & 1) * 32
                ho = o + QH + h * 32
                yb = sb * QK + h * 128 + c * 32
                for j in range(32):
                    dl = d * np.float32(scales[o + SCALES + h * 8 + c * 2 + (j >> 4)])
                    q = ((row[lo + j] >> np.uint8(4 * (c >> 1))) & np.uint8(15)) | (
                        ((row[ho + j] >> np.uint8(2 * c)) & np.uint8(3)) << np.uint8(4)
                    )
                    y[yb + j] = dl * (np.float32(q) - np.float32(32))


@njit(cache=True, inline="always")
def _superblock(acc0p, acc1p, w, r, wr, sb, xq, xd, xs, k, xk, less):
    """Super-block sb of row r against activation row k: its eight 32-element chunks' dots
    added to acc0p (even chunks) and acc1p (odd); Q6_K has no mins, so nothing to subtract."""
    o = sb * BLOCK
    d = half_at(w, r, o + D)
    for h in range(2):
        ho = wr + o + QH + h * 32
        for c in range(0, 4, 2):  # c and c + 1 share the shift of the low bits
            b = sb * XB + h * 4 + c
            s = o + SCALES + h * 8 + c * 2
            ls = 4 * (c >> 1)
            # The scales are int8: reinterpret the unsigned bytes.
            dot_q6x32(
                acc0p,
                d * xd[k, b],
                (np.int32(w[r, s]) ^ 128) - 128,
                (np.int32(w[r, s + 1]) ^ 128) - 128,
                w,
                wr + o + QL + h * 64,
                ho,
                ls,
                2 * c,
                xq,
                xk + b * QK8,
            )
            dot_q6x32(
                acc1p,
                d * xd[k, b + 1],
                (np.int32(w[r, s + 2]) ^ 128) - 128,
                (np.int32(w[r, s + 3]) ^ 128) - 128,
                w,
                wr + o + QL + h * 64 + 32,
                ho,
                ls,
                2 * c + 2,
                xq,
                xk + b * QK8 + QK8,
            )
    return less


# Each 32-element chunk meets one activation block, with its two int8 scales applied inside
# dot_q6x32.
qdot = njit(cache=True)(superblock_rows(LAYOUT, _superblock, prefetched=True))


@njit(cache=True)
def unpack(row: np.ndarray, u: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """row -> 6-bit u, and per 16 elements sc = d * scale, mn = -32 d * scale (the offset of q;
    prima.kernels.int8_gemm)."""
    scales = row.view(np.int8)
    for sb in range(u.shape[0] // QK):
        o = sb * BLOCK
        d = f16_at(row, o + D)
        for h in range(2):
            for c in range(4):
                lo = o + QL + h * 64 + (c & 1) * 32
                ho = o + QH + h * 32
                ub = sb * QK + h * 128 + c * 32
                for j in range(32):
                    u[ub + j] = ((row[lo + j] >> np.uint8(4 * (c >> 1))) & np.uint8(15)) | (
                        ((row[ho + j] >> np.uint8(2 * c)) & np.uint8(3)) << np.uint8(4)
                    )
                for p in range(2):
                    dl = d * np.float32(scales[o + SCALES + h * 8 + c * 2 + p])
                    sc[ub // 16 + p] = dl
                    mn[ub // 16 + p] = np.float32(-32.0) * dl


FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=63, unpack_piece=16)
