"""Fused numba kernels for ggml's 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each format has two per-row kernels over the raw GGUF bytes, never a dequantized copy of the weight:
  dot_<fmt>(row (row_bytes,) u8, x (n, cols) f32, lut, out (n, rows) f32, r, acc)  out[:, r] = x @ w_r
  deq_<fmt>(row, lut, y (cols,) f32)                                              y = w_r
The parallel drivers in prima.kernels.drivers run them over rows and pick the format by type id.
`lut` is quants.F16_TABLE. Values are formed exactly as gguf-py's reference forms them (d * q,
or d * q + m, in float32) and multiplied into 32 float32 lane accumulators, one per element of
a block: per-lane accumulation vectorizes without reassociating a scalar sum, which is what made
these kernels several times faster than a scalar dot on this machine. The drivers call these by
name (numba cannot cache a kernel that takes another jitted function as an argument).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@njit(cache=True, inline="always")
def _f16(lut: np.ndarray, row: np.ndarray, o: int) -> np.float32:
    """The little-endian f16 at byte `o` of `row`, as float32."""
    return lut[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@intrinsic
def stack_f32(typingctx, n):  # noqa: ANN001, ANN201, ARG001 - numba intrinsic signature
    """A pointer to n (a literal) float32 lanes on the stack. Lane accumulators must live there,
    not on the heap: only a stack array that nothing else can alias gets promoted to vector
    registers, which made the kernels ~1.6x faster than with a heap scratch array."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202, ARG001
        f32 = context.get_value_type(types.float32)
        return builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(f32, size)), f32.as_pointer())

    return types.CPointer(types.float32)(n), codegen


@njit(cache=True, inline="always")
def lane_sum(acc: np.ndarray) -> np.float32:
    s = np.float32(0.0)
    for j in range(acc.shape[0]):
        s += acc[j]
    return s


@njit(cache=True, inline="always")
def nibbles(q: np.uint8) -> tuple[np.float32, np.float32]:
    """(low, high) nibble of byte q as float32, split in the float domain (q = 16 hi + lo, exact):
    integer shifts would go through int64 lanes, which LLVM vectorizes poorly."""
    qf = np.float32(q)
    hi = np.floor(qf * np.float32(0.0625))
    return qf - np.float32(16.0) * hi, hi


@njit(cache=True, inline="always")
def _u32(row: np.ndarray, o: int) -> np.uint32:
    """The little-endian u32 at byte `o` of `row`."""
    return (
        np.uint32(row[o])
        | (np.uint32(row[o + 1]) << np.uint32(8))
        | (np.uint32(row[o + 2]) << np.uint32(16))
        | (np.uint32(row[o + 3]) << np.uint32(24))
    )


# Q4_0: 18-byte block of 32: d f16, 16 bytes of nibbles; the low nibble of byte j is element j,
# the high nibble element j + 16; value = d * (q - 8).
@njit(cache=True)
def dot_q4_0(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_blocks = x.shape[1] // 32
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * 18
            d = _f16(lut, row, o)
            xb = b * 32
            for j in range(16):
                lo, hi = nibbles(row[o + 2 + j])
                acc[j] += xk[xb + j] * (d * (lo - np.float32(8)))
                acc[j + 16] += xk[xb + 16 + j] * (d * (hi - np.float32(8)))
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q4_0(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // 32
    for b in range(n_blocks):
        o = b * 18
        d = _f16(lut, row, o)
        for j in range(16):
            q = row[o + 2 + j]
            y[b * 32 + j] = d * (np.float32(q & np.uint8(15)) - np.float32(8))
            y[b * 32 + 16 + j] = d * (np.float32(q >> np.uint8(4)) - np.float32(8))


# Q4_1: 20-byte block of 32: d f16, m f16, 16 bytes of nibbles (as Q4_0); value = d * q + m.
@njit(cache=True)
def dot_q4_1(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_blocks = x.shape[1] // 32
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * 20
            d = _f16(lut, row, o)
            m = _f16(lut, row, o + 2)
            xb = b * 32
            for j in range(16):
                lo, hi = nibbles(row[o + 4 + j])
                acc[j] += xk[xb + j] * (d * lo + m)
                acc[j + 16] += xk[xb + 16 + j] * (d * hi + m)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q4_1(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // 32
    for b in range(n_blocks):
        o = b * 20
        d = _f16(lut, row, o)
        m = _f16(lut, row, o + 2)
        for j in range(16):
            q = row[o + 4 + j]
            y[b * 32 + j] = d * np.float32(q & np.uint8(15)) + m
            y[b * 32 + 16 + j] = d * np.float32(q >> np.uint8(4)) + m


# Q5_0: 22-byte block of 32: d f16, qh (32 high bits, little-endian u32: bit j belongs to element
# j), 16 bytes of low nibbles (as Q4_0); value = d * ((nibble | high << 4) - 16).
@njit(cache=True)
def dot_q5_0(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_blocks = x.shape[1] // 32
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * 22
            d = _f16(lut, row, o)
            qh = _u32(row, o + 2)
            xb = b * 32
            for j in range(16):
                lo, hi = nibbles(row[o + 6 + j])
                h0 = np.float32((qh >> np.uint32(j)) & np.uint32(1)) * np.float32(16)
                h1 = np.float32((qh >> np.uint32(j + 16)) & np.uint32(1)) * np.float32(16)
                v0 = lo + h0 - np.float32(16)
                v1 = hi + h1 - np.float32(16)
                acc[j] += xk[xb + j] * (d * v0)
                acc[j + 16] += xk[xb + 16 + j] * (d * v1)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q5_0(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // 32
    for b in range(n_blocks):
        o = b * 22
        d = _f16(lut, row, o)
        qh = _u32(row, o + 2)
        for j in range(16):
            q = row[o + 6 + j]
            h0 = ((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4)
            h1 = ((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4)
            y[b * 32 + j] = d * (np.float32(np.uint32(q & np.uint8(15)) | h0) - np.float32(16))
            y[b * 32 + 16 + j] = d * (np.float32(np.uint32(q >> np.uint8(4)) | h1) - np.float32(16))


# Q5_1: 24-byte block of 32: d f16, m f16, qh u32 (as Q5_0), 16 bytes of low nibbles;
# value = d * (nibble | high << 4) + m.
@njit(cache=True)
def dot_q5_1(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_blocks = x.shape[1] // 32
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * 24
            d = _f16(lut, row, o)
            m = _f16(lut, row, o + 2)
            qh = _u32(row, o + 4)
            xb = b * 32
            for j in range(16):
                lo, hi = nibbles(row[o + 8 + j])
                v0 = lo + np.float32((qh >> np.uint32(j)) & np.uint32(1)) * np.float32(16)
                v1 = hi + np.float32((qh >> np.uint32(j + 16)) & np.uint32(1)) * np.float32(16)
                acc[j] += xk[xb + j] * (d * v0 + m)
                acc[j + 16] += xk[xb + 16 + j] * (d * v1 + m)
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q5_1(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // 32
    for b in range(n_blocks):
        o = b * 24
        d = _f16(lut, row, o)
        m = _f16(lut, row, o + 2)
        qh = _u32(row, o + 4)
        for j in range(16):
            q = row[o + 8 + j]
            h0 = ((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4)
            h1 = ((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4)
            y[b * 32 + j] = d * np.float32(np.uint32(q & np.uint8(15)) | h0) + m
            y[b * 32 + 16 + j] = d * np.float32(np.uint32(q >> np.uint8(4)) | h1) + m


# Q8_0: 34-byte block of 32: d f16, 32 int8; value = d * q.
@njit(cache=True)
def dot_q8_0(row: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray, r: int) -> None:
    """out[:, r] = x @ w_r for the raw bytes `row` of W's row r."""
    acc = carray(stack_f32(32), 32)
    n_blocks = x.shape[1] // 32
    qs = row.view(np.int8)
    for k in range(x.shape[0]):
        xk = x[k]
        for j in range(32):
            acc[j] = 0.0
        for b in range(n_blocks):
            o = b * 34
            d = _f16(lut, row, o)
            xb = b * 32
            for j in range(32):
                acc[j] += xk[xb + j] * (d * np.float32(qs[o + 2 + j]))
        out[k, r] = lane_sum(acc)


@njit(cache=True)
def deq_q8_0(row: np.ndarray, lut: np.ndarray, y: np.ndarray) -> None:
    """y (cols,) = the row `row` dequantized."""
    n_blocks = y.shape[0] // 32
    qs = row.view(np.int8)
    for b in range(n_blocks):
        o = b * 34
        d = _f16(lut, row, o)
        for j in range(32):
            y[b * 32 + j] = d * np.float32(qs[o + 2 + j])
