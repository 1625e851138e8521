"""Fused numba kernels for ggml's 256-element super-block ("k-quant") formats: Q2_K .. Q6_K.

Same contract and lane-accumulator scheme as legacy_quants (see there): dot_<fmt> computes
out[:, r] = x @ w_r from one row's raw blocks, deq_<fmt> dequantizes one row. Values are formed as gguf-py's
reference forms them: (d * sub-block scale) * q - (dmin * sub-block min), in float32. Every
format splits a super-block into 16 or 32-element sub-blocks, each with its own scale, so the
32 lanes process one 32-element sub-block at a time."""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.legacy_quants import _f16, lane_sum, nibbles, stack_f32

QK = 256


@njit(cache=True, inline="always")
def _scale_min_k4(row: np.ndarray, o: int, j: int) -> tuple[np.float32, np.float32]:
    """Scale and min of sub-block j (0-7) from Q4_K/Q5_K's 12 packed bytes at `o`: bytes 0-3
    hold 6-bit scales 0-3, bytes 4-7 mins 0-3 (top 2 bits of each extend scales/mins 4-7),
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    if j < 4:
        sc = row[o + j] & 63
        m = row[o + j + 4] & 63
    else:
        sc = (row[o + j + 4] & 15) | ((row[o + j - 4] >> 6) << 4)
        m = (row[o + j + 4] >> 4) | ((row[o + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(cache=True, inline="always")
def _scale_q3_k(row: np.ndarray, o: int, k: int) -> np.float32:
    """6-bit scale k (0-15) of Q3_K from its 12 bytes at `o`, minus 32: the low 4 bits are
    nibble k // 8 of byte k % 8, the high 2 bits are bits 2 * (k // 4) of byte 8 + k % 4."""
    lo = (row[o + (k & 7)] >> (4 * (k >> 3))) & 15
    hi = (row[o + 8 + (k & 3)] >> (2 * (k >> 2))) & 3
    return np.float32(np.int32(lo | (hi << 4)) - 32)


# Q2_K: 84-byte super-block of 256: scales[16] (low nibble scale, high nibble min, one per 16
# elements), qs[64] (2-bit values), d f16, dmin f16. Element h*128 + s*32 + j (h < 2, s < 4,
# j < 32) is bits 2s of qs[h*32 + j]; its sub-block (scale index) is element // 16.
@njit(cache=True)
def dot_q2_k(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * 84
            d = _f16(lut, row, o + 80)
            dmin = _f16(lut, row, o + 82)
            for h in range(2):
                for s in range(4):
                    sc0 = row[o + h * 8 + s * 2]
                    sc1 = row[o + h * 8 + s * 2 + 1]
                    dl0 = d * np.float32(sc0 & 15)
                    ml0 = dmin * np.float32(sc0 >> 4)
                    dl1 = d * np.float32(sc1 & 15)
                    ml1 = dmin * np.float32(sc1 >> 4)
                    xb = sb * QK + h * 128 + s * 32
                    qo = o + 16 + h * 32
                    for j in range(16):
                        q = (row[qo + j] >> np.uint8(2 * s)) & np.uint8(3)
                        acc[j] += xk[xb + j] * (dl0 * np.float32(q) - ml0)
                    for j in range(16):
                        q = (row[qo + 16 + j] >> np.uint8(2 * s)) & np.uint8(3)
                        acc[16 + j] += xk[xb + 16 + j] * (dl1 * np.float32(q) - ml1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q2_k(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * 84
        d = _f16(lut, row, o + 80)
        dmin = _f16(lut, row, o + 82)
        for h in range(2):
            for s in range(4):
                yb = sb * QK + h * 128 + s * 32
                for j in range(32):
                    sc = row[o + h * 8 + s * 2 + (j >> 4)]
                    q = (row[o + 16 + h * 32 + j] >> np.uint8(2 * s)) & np.uint8(3)
                    y[yb + j] = (d * np.float32(sc & 15)) * np.float32(q) - dmin * np.float32(sc >> 4)


# Q3_K: 110-byte super-block of 256: hmask[32] (high bits), qs[64] (low 2 bits), scales[12]
# (16 packed 6-bit scales, see _scale_q3_k), d f16. Element h*128 + s*32 + j takes bits 2s of
# qs[h*32 + j] and bit 4h + s of hmask[j]; a clear high bit means "subtract 4".
@njit(cache=True)
def dot_q3_k(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * 110
            d = _f16(lut, row, o + 108)
            for h in range(2):
                for s in range(4):
                    dl0 = d * _scale_q3_k(row, o + 96, h * 8 + s * 2)
                    dl1 = d * _scale_q3_k(row, o + 96, h * 8 + s * 2 + 1)
                    xb = sb * QK + h * 128 + s * 32
                    qo = o + 32 + h * 32
                    for j in range(16):
                        q = (row[qo + j] >> np.uint8(2 * s)) & np.uint8(3)
                        hb = ((row[o + j] >> np.uint8(4 * h + s)) & np.uint8(1)) << np.uint8(2)
                        acc[j] += xk[xb + j] * (dl0 * (np.float32(q | hb) - np.float32(4)))
                    for j in range(16):
                        q = (row[qo + 16 + j] >> np.uint8(2 * s)) & np.uint8(3)
                        hb = ((row[o + 16 + j] >> np.uint8(4 * h + s)) & np.uint8(1)) << np.uint8(2)
                        acc[16 + j] += xk[xb + 16 + j] * (dl1 * (np.float32(q | hb) - np.float32(4)))
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q3_k(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * 110
        d = _f16(lut, row, o + 108)
        for h in range(2):
            for s in range(4):
                yb = sb * QK + h * 128 + s * 32
                for j in range(32):
                    dl = d * _scale_q3_k(row, o + 96, h * 8 + s * 2 + (j >> 4))
                    q = (row[o + 32 + h * 32 + j] >> np.uint8(2 * s)) & np.uint8(3)
                    hb = ((row[o + j] >> np.uint8(4 * h + s)) & np.uint8(1)) << np.uint8(2)
                    y[yb + j] = dl * (np.float32(q | hb) - np.float32(4))


# Q4_K: 144-byte super-block of 256: d, dmin f16, 12 bytes of 6-bit scales/mins (8 sub-blocks
# of 32), 128 bytes of nibbles. Byte g*32 + j holds element g*64 + j (low nibble, sub-block 2g)
# and element g*64 + 32 + j (high nibble, sub-block 2g + 1).
@njit(cache=True)
def dot_q4_k(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * 144
            d = _f16(lut, row, o)
            dmin = _f16(lut, row, o + 2)
            for g in range(4):
                sc0, m0 = _scale_min_k4(row, o + 4, 2 * g)
                sc1, m1 = _scale_min_k4(row, o + 4, 2 * g + 1)
                d0 = d * sc0
                d1 = d * sc1
                dm0 = dmin * m0
                dm1 = dmin * m1
                xb = sb * QK + g * 64
                qo = o + 16 + g * 32
                for j in range(32):
                    lo, hi = nibbles(row[qo + j])
                    acc[j] += xk[xb + j] * (d0 * lo - dm0) + xk[xb + 32 + j] * (d1 * hi - dm1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q4_k(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * 144
        d = _f16(lut, row, o)
        dmin = _f16(lut, row, o + 2)
        for g in range(4):
            sc0, m0 = _scale_min_k4(row, o + 4, 2 * g)
            sc1, m1 = _scale_min_k4(row, o + 4, 2 * g + 1)
            yb = sb * QK + g * 64
            for j in range(32):
                q = row[o + 16 + g * 32 + j]
                y[yb + j] = (d * sc0) * np.float32(q & np.uint8(15)) - dmin * m0
                y[yb + 32 + j] = (d * sc1) * np.float32(q >> np.uint8(4)) - dmin * m1


# Q5_K: 176-byte super-block of 256: d, dmin f16, 12 bytes of scales/mins (as Q4_K), qh[32],
# qs[128] (nibbles as Q4_K). Element g*64 + j takes bit 2g of qh[j] as its fifth bit; element
# g*64 + 32 + j takes bit 2g + 1.
@njit(cache=True)
def dot_q5_k(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * 176
            d = _f16(lut, row, o)
            dmin = _f16(lut, row, o + 2)
            for g in range(4):
                sc0, m0 = _scale_min_k4(row, o + 4, 2 * g)
                sc1, m1 = _scale_min_k4(row, o + 4, 2 * g + 1)
                d0 = d * sc0
                d1 = d * sc1
                dm0 = dmin * m0
                dm1 = dmin * m1
                xb = sb * QK + g * 64
                qo = o + 48 + g * 32
                for j in range(32):
                    hb = ((row[o + 16 + j] >> np.uint8(2 * g)) & np.uint8(1)) << np.uint8(4)
                    q = (row[qo + j] & np.uint8(15)) | hb
                    acc[j] += xk[xb + j] * (d0 * np.float32(q) - dm0)
                for j in range(32):
                    hb = ((row[o + 16 + j] >> np.uint8(2 * g + 1)) & np.uint8(1)) << np.uint8(4)
                    q = (row[qo + j] >> np.uint8(4)) | hb
                    acc[j] += xk[xb + 32 + j] * (d1 * np.float32(q) - dm1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q5_k(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    for sb in range(n_super):
        o = sb * 176
        d = _f16(lut, row, o)
        dmin = _f16(lut, row, o + 2)
        for g in range(4):
            sc0, m0 = _scale_min_k4(row, o + 4, 2 * g)
            sc1, m1 = _scale_min_k4(row, o + 4, 2 * g + 1)
            yb = sb * QK + g * 64
            for j in range(32):
                q = row[o + 48 + g * 32 + j]
                qh = row[o + 16 + j]
                lo = (q & np.uint8(15)) | (((qh >> np.uint8(2 * g)) & np.uint8(1)) << np.uint8(4))
                hi = (q >> np.uint8(4)) | (((qh >> np.uint8(2 * g + 1)) & np.uint8(1)) << np.uint8(4))
                y[yb + j] = (d * sc0) * np.float32(lo) - dmin * m0
                y[yb + 32 + j] = (d * sc1) * np.float32(hi) - dmin * m1


# Q6_K: 210-byte super-block of 256: ql[128] (low nibbles), qh[64] (2 high bits), scales[16]
# int8 (one per 16 elements), d f16; value = d * scale * (q - 32). Within half h (128 elements),
# chunk c (32 elements) takes nibble c // 2 of ql[64h + 32 (c % 2) + j] and bits 2c of qh[32h + j].
@njit(cache=True)
def dot_q6_k(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_super = x.shape[1] // QK
    scales = row.view(np.int8)
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for sb in range(n_super):
            o = sb * 210
            d = _f16(lut, row, o + 208)
            for h in range(2):
                for c in range(4):
                    dl0 = d * np.float32(scales[o + 192 + h * 8 + c * 2])
                    dl1 = d * np.float32(scales[o + 192 + h * 8 + c * 2 + 1])
                    lo = o + h * 64 + (c & 1) * 32
                    ho = o + 128 + h * 32
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
def deq_q6_k(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_super = y.shape[0] // QK
    scales = row.view(np.int8)
    for sb in range(n_super):
        o = sb * 210
        d = _f16(lut, row, o + 208)
        for h in range(2):
            for c in range(4):
                lo = o + h * 64 + (c & 1) * 32
                ho = o + 128 + h * 32
                yb = sb * QK + h * 128 + c * 32
                for j in range(32):
                    dl = d * np.float32(scales[o + 192 + h * 8 + c * 2 + (j >> 4)])
                    q = ((row[lo + j] >> np.uint8(4 * (c >> 1))) & np.uint8(15)) | (
                        ((row[ho + j] >> np.uint8(2 * c)) & np.uint8(3)) << np.uint8(4)
                    )
                    y[yb + j] = dl * (np.float32(q) - np.float32(32))
