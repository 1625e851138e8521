"""Int8-activation ("q8") building blocks: the activation row is quantized once per matmul to int8
per 32-element block (value = xd * xq), and each weight block meets it in an int8 x int8 -> int32
dot.

This is llama.cpp's decode scheme (its vec_dot_q*_q8 kernels), written fresh for numba: the
integer dots are LLVM intrinsics built here (load the bytes as <n x i8>, unpack nibbles or high
bits as vector ops, sign-extend, multiply, add neighbouring pairs, scale into 16 float lanes),
because numba widens small-integer arithmetic to int64 lanes, which vectorizes badly. Where the
CPU has them the multiply-adds are its own int8 dot instructions: pmaddubsw or vpdpbusd on x86
(8 lanes), sdot on ARMv8.2+ (4 lanes). Results
differ from the exact float path by the activation quantization error (relative ~1e-3 per dot);
prima's exact mode keeps the float kernels.

  quantize_rows(x, xq, xd, xs)     x (n, cols) f32 -> int8 blocks, scales, sums
  dot_i8x32, dot_nib16, ...        acc += scale * (integer dot of one block), as vector code
Each format's qdot (prima.kernels.formats) is built from these, the legacy formats' through
prima.kernels.row_groups (a few activation rows per weight block); a format without one runs its
exact kernel in q8 mode.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from prima.ggml_constants import GGML_QUANT_SIZES, GGMLQuantizationType
from prima.kernels.arm_features import has_dotprod
from prima.kernels.lanes import NATIVE_HALF

# Elements per activation block: Q8_0's, the activation format of ggml's legacy-format dots.
QK8 = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


def _host_has_avx2() -> bool:
    """True when numba compiles for this host and the host has AVX2: the block dots then use
    pmaddubsw/pmaddwd (u8 x s8 pairs -> i16 -> i32), llama.cpp's instructions, instead of widening
    every byte to a 32-bit lane. numba keys its cache on the CPU, so a cache built here is not
    reused elsewhere; NUMBA_CPU_NAME (a portable build) selects the generic vector IR."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    if not llvm.get_host_cpu_name() or "x86" not in llvm.get_default_triple():
        return False
    return bool(llvm.get_host_cpu_features().get("avx2"))


def _host_has_vnni() -> bool:
    """AVX2 plus a VEX or EVEX `vpdpbusd` (AVX-VNNI, or AVX-512 VNNI with VL): four u8 x s8
    products summed into each int32 lane in one instruction, instead of pmaddubsw + pmaddwd."""
    if not AVX2:
        return False
    f = llvm.get_host_cpu_features()
    return bool(f.get("avxvnni") or (f.get("avx512vnni") and f.get("avx512vl")))


AVX2 = _host_has_avx2()
VNNI = _host_has_vnni()
# ARMv8.2's sdot (16 int8 products summed four at a time into 4 int32 lanes, one instruction),
# where the CPU and numba's target have it (prima.kernels.arm_features); ARMv8.0 cores take the
# generic code.
DOTPROD = has_dotprod()
# Float lanes a row's accumulator uses: the sdot dots give 4 int32 partial sums per block, the
# AVX2 ones 8, the generic ones 16.
LANES = 4 if DOTPROD else 8 if AVX2 else 16


# ---- LLVM building blocks -------------------------------------------------------------------


def _load(context, builder, aryty, ary, off, n):
    """<n x i8> loaded (unaligned) from byte `off` of the contiguous array `ary`."""
    data = context.make_array(aryty)(context, builder, ary).data
    base = builder.bitcast(data, _I8.as_pointer())
    ptr = builder.gep(base, [off])
    vty = ir.VectorType(_I8, n)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _splat(builder, value, n):
    """<n x i8> with every lane `value` (an LLVM integer, truncated to i8)."""
    vty = ir.VectorType(_I8, n)
    v = builder.insert_element(
        ir.Constant(vty, ir.Undefined), builder.trunc(value, _I8), ir.Constant(_I32, 0)
    )
    return builder.shuffle_vector(
        v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n)
    )


def _const(n, value):
    return ir.Constant(ir.VectorType(_I8, n), [value] * n)


def _concat(builder, lo, hi, n):
    """<2n x i8> = lo ++ hi, for two <n x i8>."""
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _accumulate(builder, acc, scale, w, x, n):
    """acc[0:LANES] += scale * (partial sums of w[j] * x[j]) for two <n x i8> (signed), n = 16 or
    32. Generic: neighbouring products are added in int32 (vpmaddwd), converted and scaled as 16
    float lanes, so the horizontal sum happens once per row, not once per block. AVX2 (n = 32):
    |w| and x with w's sign go through pmaddubsw, as for unsigned weights."""
    if AVX2 and n == 32:
        _accumulate_unsigned(builder, acc, scale, _psign(builder, w, w), _psign(builder, x, w))
        return
    if DOTPROD:
        _scaled_add(builder, acc, scale, _sdot(builder, w, x, n))
        return
    vty = ir.VectorType(_I32, n)
    prod = builder.mul(builder.sext(w, vty), builder.sext(x, vty))
    if n == 32:
        even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
        odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
        prod = builder.add(builder.shuffle_vector(prod, prod, even), builder.shuffle_vector(prod, prod, odd))
    _scaled_add(builder, acc, scale, prod)


def _accumulate_unsigned(builder, acc, scale, u, x):
    """acc += scale * (partial sums of u[j] * x[j]) for <32 x i8> u (unsigned, < 256) and x
    (signed, |x| <= 127). AVX2: pmaddubsw adds neighbouring u8 x s8 products into 16 int16, which
    cannot saturate for u <= 128 (2 * 128 * 127 < 32768; callers pass nibbles, 5- and 6-bit values
    and |int8|), and pmaddwd sums pairs into 8 int32. ARM with sdot: u < 128 (the nibbles and 5-bit
    values its callers pass) is the same number as a signed byte. Generic: zero-extended multiply."""
    if DOTPROD:
        _scaled_add(builder, acc, scale, _sdot(builder, u, x, 32))
        return
    if not AVX2:
        vty = ir.VectorType(_I32, 32)
        prod = builder.mul(builder.zext(u, vty), builder.sext(x, vty))
        even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
        odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
        prod = builder.add(builder.shuffle_vector(prod, prod, even), builder.shuffle_vector(prod, prod, odd))
        _scaled_add(builder, acc, scale, prod)
        return
    if VNNI:
        i32x8 = ir.VectorType(_I32, 8)
        zero = ir.Constant(i32x8, [0] * 8)
        lanes = _x86(
            builder,
            "llvm.x86.avx512.vpdpbusd.256",
            i32x8,
            zero,
            builder.bitcast(u, i32x8),
            builder.bitcast(x, i32x8),
        )
        _scaled_add(builder, acc, scale, lanes)
        return
    pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), u, x)
    ones = ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
    _scaled_add(
        builder, acc, scale, _x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), pairs, ones)
    )


def _sdot(builder, w, x, n):
    """<4 x i32>: lane i sums w[j] * x[j] over j = 4i..4i+3 of each 16-byte chunk of the two signed
    <n x i8> (n = 16 or 32), one `sdot` per chunk (only reached when DOTPROD is true)."""
    i32x4 = ir.VectorType(_I32, 4)
    i8x16 = ir.VectorType(_I8, 16)
    fnty = ir.FunctionType(i32x4, [i32x4, i8x16, i8x16])
    sdot = cgutils.get_or_insert_function(builder.module, fnty, "llvm.aarch64.neon.sdot.v4i32.v16i8")
    lanes = ir.Constant(i32x4, [0] * 4)
    for start in range(0, n, 16):
        chunk = ir.Constant(ir.VectorType(_I32, 16), list(range(start, start + 16)))
        wc = w if n == 16 else builder.shuffle_vector(w, w, chunk)
        xc = x if n == 16 else builder.shuffle_vector(x, x, chunk)
        lanes = builder.call(sdot, [lanes, wc, xc])
    return lanes


def _x86(builder, name, ret, *args):
    """A call of the x86 intrinsic `name` (only reached when AVX2 is true)."""
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _psign(builder, v, s):
    """v with each lane negated where s < 0 and zeroed where s == 0 (psignb)."""
    return _x86(builder, "llvm.x86.avx2.psign.b", v.type, v, s)


def _scaled_add(builder, acc, scale, lanes):
    """acc[0:len(lanes)] += scale * float(lanes) for an <n x i32> of partial sums."""
    n = lanes.type.count
    fty = ir.VectorType(ir.FloatType(), n)
    pf = builder.sitofp(lanes, fty)
    sv = builder.insert_element(ir.Constant(fty, ir.Undefined), scale, ir.Constant(_I32, 0))
    sv = builder.shuffle_vector(
        sv, ir.Constant(fty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n)
    )
    ptr = builder.bitcast(acc, fty.as_pointer())
    fmuladd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(fty, [fty, fty, fty]), f"llvm.fmuladd.v{n}f32"
    )
    builder.store(builder.call(fmuladd, [pf, sv, builder.load(ptr, align=4)]), ptr, align=4)


def _i64(builder, value, ty):
    return builder.sext(value, ir.IntType(64)) if ty.bitwidth < 64 else value


@intrinsic
def f16_at(typingctx, w, off):
    """The little-endian IEEE half at byte `off` of the array `w`, as float32."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.gep(builder.bitcast(data, _I8.as_pointer()), [_i64(builder, args[1], sig.args[1])])
        if NATIVE_HALF:
            half = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=1)
            return builder.fpext(half, ir.FloatType())
        return _half_bits_to_float(builder, builder.load(builder.bitcast(ptr, _I16.as_pointer()), align=1))

    return types.float32(w, off), codegen


# Bytes ahead of the current block that the kernels ask the CPU to fetch: a page. Weights come
# from page-cache pages, 4 KiB each and scattered in physical memory, where the hardware
# prefetcher stops at every page boundary; a software prefetch crosses it. A page ahead beat
# 1 KiB on machine C (docs/performance.md), for quantized blocks and float rows alike.
# A constant, not a setting: numba compiles it into cached kernels, which would ignore a change.
PREFETCH_AHEAD = 4096
CACHE_LINE = 64  # bytes: blocks longer than a line ask for each of their lines


@intrinsic
def prefetch(typingctx, w, off):
    """Hint the CPU to load the cache line at byte `off` of the array `w` (never faults)."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.gep(builder.bitcast(data, _I8.as_pointer()), [_i64(builder, args[1], sig.args[1])])
        fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    return types.void(w, off), codegen


def _half_bits_to_float(builder, h):
    """float32 of the IEEE half with bits h (i16), by integer ops: the exponent and mantissa move
    up 13 bits, a multiply by 2^112 rebiases the exponent (and normalizes subnormals), and
    infinities and NaNs get the float32 all-ones exponent."""
    h32 = builder.zext(h, _I32)
    magnitude = builder.shl(builder.and_(h32, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13))
    f = builder.fmul(builder.bitcast(magnitude, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0**112))
    bits = builder.bitcast(f, _I32)
    is_special = builder.icmp_unsigned(
        "==", builder.and_(h32, ir.Constant(_I32, 0x7C00)), ir.Constant(_I32, 0x7C00)
    )
    bits = builder.select(is_special, builder.or_(bits, ir.Constant(_I32, 0x7F800000)), bits)
    sign = builder.shl(builder.and_(h32, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16))
    return builder.bitcast(builder.or_(bits, sign), ir.FloatType())


# ---- integer block dots ---------------------------------------------------------------------
# Each takes the weight row with byte offsets and the int8 activation row with an element offset.


@intrinsic
def dot_i8x32(typingctx, acc, scale, w, wo, x, xo):
    """acc += scale * int8(w[wo + j]) * x[xo + j], j < 32 (Q8_0's quants)."""

    def codegen(context, builder, sig, args):
        a = sig.args
        wv = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 32)
        xv = _load(context, builder, a[4], args[4], _i64(builder, args[5], a[5]), 32)
        _accumulate(builder, args[0], args[1], wv, xv, 32)

    return types.void(acc, types.float32, w, wo, x, xo), codegen


@intrinsic
def dot_nib16(typingctx, acc, scale, w, wo, qh, x, xo):
    """acc += scale * v_j * x[xo + j], j < 32, for a legacy 4/5-bit block (v_j unsigned; the
    caller subtracts Q4_0's and Q5_0's offset through the block sum of x): 16 bytes at wo hold
    v_j's low nibble (j < 16) and v_{j+16}'s (high nibble); bit j of the u32 `qh` is v_j's bit 4
    (pass 0 for 4-bit formats)."""

    def codegen(context, builder, sig, args):
        a = sig.args
        raw = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 16)
        lo = builder.and_(raw, _const(16, 15))
        hi = builder.lshr(raw, _const(16, 4))
        v = _concat(builder, lo, hi, 16)
        v = builder.or_(v, _high_bits(builder, builder.trunc(args[4], _I32)))
        xv = _load(context, builder, a[5], args[5], _i64(builder, args[6], a[6]), 32)
        _accumulate_unsigned(builder, args[0], args[1], v, xv)

    return types.void(acc, types.float32, w, wo, qh, x, xo), codegen


def _high_bits(builder, qh):
    """<32 x i8>: 16 in lane j where bit j of the i32 `qh` is set, else 0. AVX2 takes it as a
    <32 x i1> bitcast, which LLVM lowers well there; elsewhere (AArch64: ~100 scalar instructions
    for that bitcast) byte j / 8 of qh is copied to lanes j and tested against 1 << (j % 8): a
    table lookup, an and and a compare."""
    i8x32 = ir.VectorType(_I8, 32)
    if AVX2:
        bits = builder.bitcast(qh, ir.VectorType(ir.IntType(1), 32))
        return builder.shl(builder.zext(bits, i8x32), _const(32, 4))
    qbytes = builder.bitcast(qh, ir.VectorType(_I8, 4))
    spread = builder.shuffle_vector(
        qbytes, qbytes, ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)])
    )
    masks = ir.Constant(i8x32, [1 << (j % 8) for j in range(32)])
    is_set = builder.icmp_unsigned("!=", builder.and_(spread, masks), _const(32, 0))
    return builder.select(is_set, _const(32, 16), _const(32, 0))


def _nib32(high: bool):
    """An intrinsic for one Q4_K sub-block: acc += scale * q_j * x[xo + j], j < 32, where q_j is
    the low (or, with `high`, the high) nibble of w[wo + j]; the shift is a constant, so it
    compiles to one vector shift instead of a per-lane variable one."""

    @intrinsic
    def dot(typingctx, acc, scale, w, wo, x, xo):
        def codegen(context, builder, sig, args):
            a = sig.args
            raw = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 32)
            v = builder.lshr(raw, _const(32, 4)) if high else builder.and_(raw, _const(32, 15))
            xv = _load(context, builder, a[4], args[4], _i64(builder, args[5], a[5]), 32)
            _accumulate_unsigned(builder, args[0], args[1], v, xv)

        return types.void(acc, types.float32, w, wo, x, xo), codegen

    return dot


dot_lo32 = _nib32(high=False)
dot_hi32 = _nib32(high=True)


def _nib5_32(high: bool):
    """An intrinsic for one Q5_K sub-block: acc += scale * q_j * x[xo + j], j < 32, where q_j is
    the low (or, with `high`, the high) nibble of w[wo + j] with bit `bit` of w[ho + j] as its
    fifth bit (q_j < 32)."""

    @intrinsic
    def dot(typingctx, acc, scale, w, wo, ho, bit, x, xo):
        def codegen(context, builder, sig, args):
            a = sig.args
            raw = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 32)
            v = builder.lshr(raw, _const(32, 4)) if high else builder.and_(raw, _const(32, 15))
            qh = _load(context, builder, a[2], args[2], _i64(builder, args[4], a[4]), 32)
            fifth = builder.and_(builder.lshr(qh, _splat(builder, args[5], 32)), _const(32, 1))
            v = builder.or_(v, builder.shl(fifth, _const(32, 4)))
            xv = _load(context, builder, a[6], args[6], _i64(builder, args[7], a[7]), 32)
            _accumulate_unsigned(builder, args[0], args[1], v, xv)

        return types.void(acc, types.float32, w, wo, ho, bit, x, xo), codegen

    return dot


dot5_lo32 = _nib5_32(high=False)
dot5_hi32 = _nib5_32(high=True)


@intrinsic
def dot_q6x32(typingctx, acc, dx, s0, s1, w, lo, hi, lshift, hshift, x, xo):
    """acc += dx * s_j * (q_j - 32) * x[xo + j], j < 32, for 32 Q6_K values with the int8 scale
    s0 for j < 16 and s1 above: q_j = ((w[lo + j] >> lshift) & 15) | (((w[hi + j] >> hshift) & 3)
    << 4). AVX2 applies both scales in one pmaddwd (int16 pair sums times int16 scales)."""

    def codegen(context, builder, sig, args):
        a = sig.args
        lv = _load(context, builder, a[4], args[4], _i64(builder, args[5], a[5]), 32)
        hv = _load(context, builder, a[4], args[4], _i64(builder, args[6], a[6]), 32)
        lv = builder.and_(builder.lshr(lv, _splat(builder, args[7], 32)), _const(32, 15))
        hv = builder.and_(builder.lshr(hv, _splat(builder, args[8], 32)), _const(32, 3))
        v = builder.sub(builder.or_(lv, builder.shl(hv, _const(32, 4))), _const(32, 32))
        xv = _load(context, builder, a[9], args[9], _i64(builder, args[10], a[10]), 32)
        s0 = builder.trunc(args[2], _I16) if a[2].bitwidth > 16 else builder.sext(args[2], _I16)
        s1 = builder.trunc(args[3], _I16) if a[3].bitwidth > 16 else builder.sext(args[3], _I16)
        if AVX2:
            pairs = _x86(
                builder,
                "llvm.x86.avx2.pmadd.ub.sw",
                ir.VectorType(_I16, 16),
                _psign(builder, v, v),
                _psign(builder, xv, v),
            )
            scales = ir.Constant(ir.VectorType(_I16, 16), ir.Undefined)
            for j in range(16):
                scales = builder.insert_element(scales, s0 if j < 8 else s1, ir.Constant(_I32, j))
            lanes = _x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), pairs, scales)
            _scaled_add(builder, args[0], args[1], lanes)
            return
        half = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
        upper = ir.Constant(ir.VectorType(_I32, 16), list(range(16, 32)))
        for s, sel in ((s0, half), (s1, upper)):
            scale = builder.fmul(args[1], builder.sitofp(s, ir.FloatType()))
            vh = builder.shuffle_vector(v, v, sel)
            xh = builder.shuffle_vector(xv, xv, sel)
            _accumulate(builder, args[0], scale, vh, xh, 16)

    return types.void(acc, types.float32, s0, s1, w, lo, hi, lshift, hshift, x, xo), codegen


@intrinsic
def hsum(typingctx, acc):
    """The sum of the LANES float lanes at `acc`, added as a tree (log2 dependent adds)."""

    def codegen(context, builder, sig, args):
        fty = ir.VectorType(ir.FloatType(), LANES)
        v = builder.load(builder.bitcast(args[0], fty.as_pointer()), align=4)
        n = LANES
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(acc), codegen


# ---- activations ----------------------------------------------------------------------------


@njit(cache=True)
def quantize_rows(x: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> None:
    """x (n, cols) f32 -> xq (n, cols) int8, xd (n, cols/QK8) scales, xs (n, cols/QK8) block
    sums: per block of QK8 = 32, xd = max|x| / 127, xq = round(x / xd), so x ~ xd * xq, and
    xs = xd * sum(xq). xs sums the quantized values, not x: a weight d * q + m then meets one
    consistent activation (the m term cancels d * q's error instead of adding to it; Q4_1's mins
    are ~|d * q|)."""
    for k in range(x.shape[0]):
        for b in range(x.shape[1] // QK8):
            amax = np.float32(0.0)
            for j in range(QK8):
                amax = max(amax, abs(x[k, b * QK8 + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s = 0
            for j in range(QK8):
                q = np.int8(np.rint(x[k, b * QK8 + j] * inv))
                xq[k, b * QK8 + j] = q
                s += q
            xd[k, b] = d
            xs[k, b] = d * np.float32(s)


# ---- row-range kernels ----------------------------------------------------------------------
# A format's qdot computes out[k, c0 + r - r0] for rows r in [r0, r1) of w: the sum over blocks of
# (weight scale * xd) * integer dot, in float lanes on the stack (promoted to a register), plus the
# weight's min times the block sum of x where the format has one. They take whole 2-D arrays and
# byte offsets, not row views: a view per row costs a reference-count round trip, as much as the
# row's math. The helpers below are shared by the formats' qdot kernels.


@njit(cache=True, inline="always")
def zero_lanes(acc: np.ndarray) -> None:
    for j in range(LANES):
        acc[j] = 0.0


@njit(cache=True, inline="always")
def half_at(w: np.ndarray, r: int, o: int) -> np.float32:
    """The little-endian f16 at byte `o` of row r of `w`, as float32 (converted by the CPU; the
    256 KiB lookup table the exact kernels use competes with the weights for cache)."""
    return f16_at(w, r * w.strides[0] + o)


@njit(cache=True, inline="always")
def u32_at(w: np.ndarray, r: int, o: int) -> np.uint32:
    """The little-endian u32 at byte `o` of row r of `w`."""
    return (
        np.uint32(w[r, o])
        | (np.uint32(w[r, o + 1]) << np.uint32(8))
        | (np.uint32(w[r, o + 2]) << np.uint32(16))
        | (np.uint32(w[r, o + 3]) << np.uint32(24))
    )


@intrinsic
def affine_scales4(typingctx, w, off, stride, xd, xs, xo, accm):
    """For the four blocks `stride` bytes apart whose halves d and m begin at byte `off` of the
    array w: returns (d_j * xd_j for j < 4) and adds m_j * xs_j to the 4 float lanes at accm,
    where xd_j, xs_j are elements xo + j of the C-contiguous arrays xd, xs. The eight halves are
    converted by one instruction (NATIVE_HALF only)."""

    def codegen(context, builder, sig, args):
        a = sig.args
        off = _i64(builder, args[1], a[1])
        stride = _i64(builder, args[2], a[2])
        i32x4 = ir.VectorType(_I32, 4)
        f32x4 = ir.VectorType(ir.FloatType(), 4)
        pairs = ir.Constant(i32x4, ir.Undefined)
        for j in range(4):
            at = builder.add(off, builder.mul(stride, ir.Constant(off.type, j)))
            ptr = builder.bitcast(_byte_ptr(context, builder, a[0], args[0], at), _I32.as_pointer())
            pairs = builder.insert_element(pairs, builder.load(ptr, align=1), ir.Constant(_I32, j))
        halves = builder.fpext(
            builder.bitcast(pairs, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(ir.FloatType(), 8)
        )
        d = builder.shuffle_vector(halves, halves, ir.Constant(i32x4, [0, 2, 4, 6]))
        m = builder.shuffle_vector(halves, halves, ir.Constant(i32x4, [1, 3, 5, 7]))
        xo = builder.mul(_i64(builder, args[5], a[5]), ir.Constant(ir.IntType(64), 4))

        def scales(i: int) -> ir.Value:
            ptr = builder.bitcast(_byte_ptr(context, builder, a[i], args[i], xo), f32x4.as_pointer())
            return builder.load(ptr, align=4)

        dx = builder.fmul(d, scales(3))
        acc = builder.bitcast(args[6], f32x4.as_pointer())
        builder.store(builder.fadd(builder.load(acc, align=4), builder.fmul(m, scales(4))), acc, align=4)
        lanes = [builder.extract_element(dx, ir.Constant(_I32, j)) for j in range(4)]
        return context.make_tuple(builder, sig.return_type, lanes)

    return types.UniTuple(types.float32, 4)(w, off, stride, xd, xs, xo, accm), codegen


def _byte_ptr(context, builder, aryty, ary, off):
    """An i8 pointer to byte `off` of the contiguous array `ary`."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.gep(builder.bitcast(data, _I8.as_pointer()), [off])
