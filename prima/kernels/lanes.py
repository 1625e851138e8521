"""Building blocks of the float32 ("exact") kernels of prima.kernels.formats.

Those kernels read a row's raw GGUF bytes, never a dequantized copy of the weight, form each value
exactly as gguf-py's reference forms it (d * q, d * q + m, (d * scale) * q - dmin * min, in
float32) and multiply it into 32 float32 lane accumulators, one per element of a 32-element block
or sub-block: per-lane accumulation vectorizes without reassociating a scalar sum, which made
these kernels several times faster than a scalar dot on this machine.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


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
def stack_f32(typingctx, n):  # numba intrinsic signature
    """A pointer to n (a literal) float32 lanes on the stack. Lane accumulators must live there,
    not on the heap: only a stack array that nothing else can alias gets promoted to vector
    registers; a heap array is reloaded and stored on every block."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        f32 = context.get_value_type(types.float32)
        return builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(f32, size)), f32.as_pointer())

    return types.CPointer(types.float32)(n), codegen


@intrinsic
def f32_bits(typingctx, v):  # numba intrinsic signature
    """The bits of a float32 as a uint32."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):  # numba intrinsic signature
    """The float32 whose bits are a uint32."""

    def codegen(context, builder, sig, args):
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


def _native_half() -> bool:
    """True when the target converts IEEE halves in hardware (x86 F16C: vcvtph2ps / vcvtps2ph,
    any AArch64); elsewhere LLVM would call a runtime helper that numba's JIT does not provide
    (a portable build, NUMBA_CPU_NAME=generic, aborted on it), so halves convert by bits."""
    triple = llvm.get_default_triple()
    if "aarch64" in triple or "arm64" in triple:
        return True
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    return bool(llvm.get_host_cpu_features().get("f16c"))


NATIVE_HALF = _native_half()


@intrinsic
def half_to_f32(typingctx, h16):  # numba intrinsic signature
    """An IEEE half (its uint16 bits) as float32, exactly: the CPU's conversion instruction where
    it has one (NATIVE_HALF), which LLVM vectorizes to 8-16 halves per instruction: ~4x
    faster than widen_half's bit arithmetic over a row of a KV cache. Equal to numpy's
    astype(float32) for all 65536 halves either way (tests/kernels/test_lanes.py)."""
    if not (isinstance(h16, types.Integer) and h16.bitwidth == 16 and not h16.signed):
        return None

    def codegen(context, builder, sig, args):
        if NATIVE_HALF:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return context.compile_internal(builder, widen_half.py_func, sig, args)

    return types.float32(h16), codegen


@njit(cache=True)
def f16_bits(v: np.float32) -> np.uint16:
    """The IEEE half nearest to v (ties to even, as numpy's astype(float16)), as its bits."""
    u = f32_bits(np.float32(v))
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    u &= np.uint32(0x7FFFFFFF)
    if u > np.uint32(0x7F800000):  # NaN stays a (quiet) NaN
        return np.uint16(sign | np.uint32(0x7E00))
    if u >= np.uint32(0x477FF000):  # 65520 and above, and infinity, round to infinity
        return np.uint16(sign | np.uint32(0x7C00))
    if u < np.uint32(0x38800000):  # below 2^-14: a subnormal half (or zero), in units of 2^-24
        return np.uint16(sign | np.uint32(np.rint(bits_f32(u) * np.float32(16777216.0))))
    r = u - np.uint32(0x38000000)  # rebias the exponent from 127 to 15
    r = r + np.uint32(0x0FFF) + ((r >> np.uint32(13)) & np.uint32(1))  # round to nearest even
    return np.uint16(sign | (r >> np.uint32(13)))


@intrinsic
def half_bits(typingctx, v):  # numba intrinsic signature
    """f16_bits, by the CPU's conversion instruction where it has one (NATIVE_HALF:
    vcvtps2ph rounds to nearest even, as f16_bits and numpy do)."""
    if not isinstance(v, types.Float):
        return None

    def codegen(context, builder, sig, args):
        if NATIVE_HALF:
            x = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))
        return context.compile_internal(builder, f16_bits.py_func, sig, args)

    return types.uint16(v), codegen


@njit(cache=True, inline="always")
def round_to_half(v: np.float32) -> np.float32:
    """v rounded to the nearest half, as float32."""
    return half_to_f32(half_bits(v))


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
def pairwise_sum32(lanes: np.ndarray) -> np.float32:
    """The sum of 32 float32 lanes, halved pairwise (16 + 8 + 4 + 2 + 1 adds, a fixed order).
    Attention sums one short dot per cached position, where lane_sum's 32 dependent adds cost more
    than the multiplies."""
    for j in range(16):
        lanes[j] += lanes[j + 16]
    for j in range(8):
        lanes[j] += lanes[j + 8]
    for j in range(4):
        lanes[j] += lanes[j + 4]
    return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])


# exp(x) = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2; ln 2 in two parts so that n ln 2 is
# exact in the first. The polynomial is e^r's Taylor series with its coefficients refitted for
# float32 on that interval (Cephes' expf).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.33654)  # below: 0 (the true value is subnormal, under 1.2e-38)
_EXP_MAX = np.float32(88.72283)  # above: infinity
_EXP_P = (
    np.float32(1.9875691500e-4),
    np.float32(1.3981999507e-3),
    np.float32(8.3334519073e-3),
    np.float32(4.1665795894e-2),
    np.float32(1.6666665459e-1),
    np.float32(5.0000001201e-1),
)


@njit(cache=True, inline="always")
def exp_f32(x: np.float32) -> np.float32:
    """e^x in float32 within 1 ulp, branch-free, so that a loop of them vectorizes (math.exp is a
    scalar libm call per element, which keeps a row of softmax scores or a SiLU scalar). NaN stays
    NaN; below -87.34 the result is 0 rather than a subnormal."""
    xc = min(max(x, _EXP_MIN), _EXP_MAX)
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = _EXP_P[0]
    p = p * r + _EXP_P[1]
    p = p * r + _EXP_P[2]
    p = p * r + _EXP_P[3]
    p = p * r + _EXP_P[4]
    p = p * r + _EXP_P[5]
    y = p * (r * r) + r + np.float32(1.0)
    # 2^n from its exponent bits; n = 128 (x near the top) is 2^127 * 2.
    top = n > np.float32(127.0)
    scale = bits_f32(np.uint32(np.int32(n - np.float32(top)) + np.int32(127)) << np.uint32(23))
    out = y * scale * (np.float32(1.0) + np.float32(top))
    if x < _EXP_MIN:
        out = np.float32(0.0)
    elif x > _EXP_MAX:
        out = np.float32(np.inf)
    elif x != x:
        out = x
    return out


def as_float32(v):  # typed by the overload below inside compiled code
    """A stored value as float32: a half's uint16 bits widened exactly (half_to_f32), a float32
    as is. Compiled code picks the form by the array's dtype, so one kernel reads a KV cache of
    either kind (prima.weights.kv_cache)."""
    return np.float32(v)


@overload(as_float32, inline="always")
def _as_float32_typed(v):
    if isinstance(v, types.Integer) and v.bitwidth == 16 and not v.signed:
        return lambda v: half_to_f32(v)
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    return None


def holds_halves(a):  # typed by the overload below inside compiled code
    """Whether array `a` holds halves as uint16 bits (as_float32's widening form): a constant of
    the compiled variant, so the branch it picks costs nothing."""
    return a.dtype == np.uint16


@overload(holds_halves, inline="always")
def _holds_halves_typed(a):
    dtype = getattr(a, "dtype", None)
    flag = isinstance(dtype, types.Integer) and dtype.bitwidth == 16 and not dtype.signed
    return lambda a: flag
