"""Building blocks of the float32 ("exact") kernels of prima.kernels.formats.

Those kernels read a row's raw GGUF bytes, never a dequantized copy of the weight, form each value
exactly as gguf-py's reference forms it (d * q, d * q + m, (d * scale) * q - dmin * min, in
float32) and multiply it into 32 float32 lane accumulators, one per element of a 32-element block
or sub-block: per-lane accumulation vectorizes without reassociating a scalar sum, which made
these kernels several times faster than a scalar dot on this machine.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@njit(cache=True, inline="always")
def half(lut: np.ndarray, row: np.ndarray, o: int) -> np.float32:
    """The little-endian f16 at byte `o` of `row`, as float32 (lut is quants.F16_TABLE)."""
    return lut[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@njit(cache=True, inline="always")
def u32(row: np.ndarray, o: int) -> np.uint32:
    """The little-endian u32 at byte `o` of `row`."""
    return (
        np.uint32(row[o])
        | (np.uint32(row[o + 1]) << np.uint32(8))
        | (np.uint32(row[o + 2]) << np.uint32(16))
        | (np.uint32(row[o + 3]) << np.uint32(24))
    )


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


@intrinsic
def f32_bits(typingctx, v):  # noqa: ANN001, ANN201, ARG001 - numba intrinsic signature
    """The bits of a float32 as a uint32."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202, ARG001
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):  # noqa: ANN001, ANN201, ARG001 - numba intrinsic signature
    """The float32 whose bits are a uint32."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202, ARG001
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(cache=True, inline="always")
def widen_half(h16: np.uint16) -> np.float32:
    """An IEEE half (its bits) as float32, exactly, without a table: exponent and mantissa moved
    into float32's places and scaled by 2^112 (which also normalizes subnormal halves), infinity
    and NaN given float32's all-ones exponent, the sign put back. Branch-free, so a row of them
    vectorizes (twice as fast as looking each up in quants.F16_TABLE); equal to numpy's
    astype(float32) for all 65536 halves (tests/kernels/test_half_weights.py)."""
    h = np.uint32(h16)
    mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
    f = bits_f32(mag) * np.float32(5.192296858534828e33)  # 2^112
    special = np.uint32(0x7F800000) * np.uint32(mag >= np.uint32(0x0F800000))
    return bits_f32(f32_bits(f) | special | ((h & np.uint32(0x8000)) << np.uint32(16)))


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
