"""Int8-activation ("q8") kernels: the activation row is quantized once per matmul to int8 per
32-element block (value = xd * xq), and each weight block meets it in an int8 x int8 -> int32 dot.

This is llama.cpp's decode scheme (its vec_dot_q*_q8 kernels), written fresh for numba: the
integer dots are LLVM intrinsics built here (load the bytes as <n x i8>, unpack nibbles or high
bits as vector ops, sign-extend, multiply, add neighbouring pairs, scale into 16 float lanes),
because numba widens small-integer arithmetic to int64 lanes, which vectorizes badly. Results differ from the exact float path by the activation
quantization error (relative ~1e-3 per dot); prima's exact mode keeps the float kernels.

  quantize_rows(x, xq, xd, xs)                       x (n, cols) f32 -> int8 blocks, scales, sums
  qdot_<fmt>(w, r0, r1, xq, xd, xs, out, c0)    out[:, c0 + i] = x @ w[r0 + i], for the drivers
Supported: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K; other formats run the exact kernels.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from prima.kernels.legacy_quants import stack_f32

QK = 256
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)


# ---- LLVM building blocks -------------------------------------------------------------------


def _load(context, builder, aryty, ary, off, n):  # noqa: ANN001, ANN202
    """<n x i8> loaded (unaligned) from byte `off` of the contiguous array `ary`."""
    data = context.make_array(aryty)(context, builder, ary).data
    base = builder.bitcast(data, _I8.as_pointer())
    ptr = builder.gep(base, [off])
    vty = ir.VectorType(_I8, n)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _splat(builder, value, n):  # noqa: ANN001, ANN202
    """<n x i8> with every lane `value` (an LLVM integer, truncated to i8)."""
    vty = ir.VectorType(_I8, n)
    v = builder.insert_element(
        ir.Constant(vty, ir.Undefined), builder.trunc(value, _I8), ir.Constant(_I32, 0)
    )
    return builder.shuffle_vector(
        v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n)
    )


def _const(n, value):  # noqa: ANN001, ANN202
    return ir.Constant(ir.VectorType(_I8, n), [value] * n)


def _concat(builder, lo, hi, n):  # noqa: ANN001, ANN202
    """<2n x i8> = lo ++ hi, for two <n x i8>."""
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _accumulate(builder, acc, scale, w, x, n):  # noqa: ANN001, ANN202
    """acc[0:16] += scale * (partial sums of w[j] * x[j]) for two <n x i8> (signed), n = 16 or
    32: neighbouring products are added in int32 (vpmaddwd), converted and scaled as 16 float
    lanes, so the horizontal sum happens once per row, not once per block."""
    vty = ir.VectorType(_I32, n)
    prod = builder.mul(builder.sext(w, vty), builder.sext(x, vty))
    if n == 32:
        even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
        odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
        prod = builder.add(builder.shuffle_vector(prod, prod, even), builder.shuffle_vector(prod, prod, odd))
    fty = ir.VectorType(ir.FloatType(), 16)
    pf = builder.sitofp(prod, fty)
    sv = builder.insert_element(ir.Constant(fty, ir.Undefined), scale, ir.Constant(_I32, 0))
    sv = builder.shuffle_vector(
        sv, ir.Constant(fty, ir.Undefined), ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
    )
    ptr = builder.bitcast(acc, fty.as_pointer())
    total = builder.fadd(builder.load(ptr, align=4), builder.fmul(pf, sv))
    builder.store(total, ptr, align=4)


def _i64(builder, value, ty):  # noqa: ANN001, ANN202
    return builder.sext(value, ir.IntType(64)) if ty.bitwidth < 64 else value


@intrinsic
def f16_at(typingctx, w, off):  # noqa: ANN001, ANN201, ARG001
    """The little-endian IEEE half at byte `off` of the array `w`, as float32."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.gep(builder.bitcast(data, _I8.as_pointer()), [_i64(builder, args[1], sig.args[1])])
        half = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(half, ir.FloatType())

    return types.float32(w, off), codegen


# ---- integer block dots ---------------------------------------------------------------------
# Each takes the weight row with byte offsets and the int8 activation row with an element offset.


@intrinsic
def dot_i8x32(typingctx, acc, scale, w, wo, x, xo):  # noqa: ANN001, ANN201, ARG001
    """acc += scale * int8(w[wo + j]) * x[xo + j], j < 32 (Q8_0's quants)."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        a = sig.args
        wv = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 32)
        xv = _load(context, builder, a[4], args[4], _i64(builder, args[5], a[5]), 32)
        _accumulate(builder, args[0], args[1], wv, xv, 32)

    return types.void(acc, types.float32, w, wo, x, xo), codegen


@intrinsic
def dot_nib16(typingctx, acc, scale, w, wo, qh, bias, x, xo):  # noqa: ANN001, ANN201, ARG001
    """acc += scale * (v_j - bias) * x[xo + j], j < 32, for a legacy 4/5-bit block: 16 bytes at
    wo hold v_j's low nibble (j < 16) and v_{j+16}'s (high nibble); bit j of the u32 `qh` is v_j's
    bit 4 (pass 0 for 4-bit formats)."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        a = sig.args
        raw = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 16)
        lo = builder.and_(raw, _const(16, 15))
        hi = builder.lshr(raw, _const(16, 4))
        v = _concat(builder, lo, hi, 16)
        bits = builder.bitcast(builder.trunc(args[4], _I32), ir.VectorType(ir.IntType(1), 32))
        v = builder.or_(v, builder.shl(builder.zext(bits, ir.VectorType(_I8, 32)), _const(32, 4)))
        v = builder.sub(v, _splat(builder, args[5], 32))
        xv = _load(context, builder, a[6], args[6], _i64(builder, args[7], a[7]), 32)
        _accumulate(builder, args[0], args[1], v, xv, 32)

    return types.void(acc, types.float32, w, wo, qh, bias, x, xo), codegen


def _nib32(high: bool):  # noqa: ANN202
    """An intrinsic for one Q4_K sub-block: acc += scale * q_j * x[xo + j], j < 32, where q_j is
    the low (or, with `high`, the high) nibble of w[wo + j]; the shift is a constant, so it
    compiles to one vector shift instead of a per-lane variable one."""

    @intrinsic
    def dot(typingctx, acc, scale, w, wo, x, xo):  # noqa: ANN001, ANN202, ARG001
        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            a = sig.args
            raw = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 32)
            v = builder.lshr(raw, _const(32, 4)) if high else builder.and_(raw, _const(32, 15))
            xv = _load(context, builder, a[4], args[4], _i64(builder, args[5], a[5]), 32)
            _accumulate(builder, args[0], args[1], v, xv, 32)

        return types.void(acc, types.float32, w, wo, x, xo), codegen

    return dot


dot_lo32 = _nib32(high=False)
dot_hi32 = _nib32(high=True)


@intrinsic
def dot_q6x16(typingctx, acc, scale, w, lo, hi, lshift, hshift, x, xo):  # noqa: ANN001, ANN201, ARG001
    """acc += scale * (q_j - 32) * x[xo + j], j < 16, for 16 Q6_K values:
    q_j = ((w[lo + j] >> lshift) & 15) | (((w[hi + j] >> hshift) & 3) << 4)."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        a = sig.args
        lv = _load(context, builder, a[2], args[2], _i64(builder, args[3], a[3]), 16)
        hv = _load(context, builder, a[2], args[2], _i64(builder, args[4], a[4]), 16)
        lv = builder.and_(builder.lshr(lv, _splat(builder, args[5], 16)), _const(16, 15))
        hv = builder.and_(builder.lshr(hv, _splat(builder, args[6], 16)), _const(16, 3))
        v = builder.sub(builder.or_(lv, builder.shl(hv, _const(16, 4))), _const(16, 32))
        xv = _load(context, builder, a[7], args[7], _i64(builder, args[8], a[8]), 16)
        _accumulate(builder, args[0], args[1], v, xv, 16)

    return types.void(acc, types.float32, w, lo, hi, lshift, hshift, x, xo), codegen


@intrinsic
def hsum16(typingctx, acc):  # noqa: ANN001, ANN201, ARG001
    """The sum of the 16 float lanes at `acc`, added as a tree (4 dependent adds, not 16)."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        fty = ir.VectorType(ir.FloatType(), 16)
        v = builder.load(builder.bitcast(args[0], fty.as_pointer()), align=4)
        n = 16
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
    """x (n, cols) f32 -> xq (n, cols) int8, xd (n, cols/32) scales, xs (n, cols/32) block sums:
    per block, xd = max|x| / 127, xq = round(x / xd), so x ~ xd * xq, and xs = xd * sum(xq).
    xs sums the quantized values, not x: a weight d * q + m then meets one consistent activation
    (the m term cancels d * q's error instead of adding to it; Q4_1's mins are ~|d * q|)."""
    for k in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[k, b * 32 + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                q = np.int8(np.rint(x[k, b * 32 + j] * inv))
                xq[k, b * 32 + j] = q
                s += q
            xd[k, b] = d
            xs[k, b] = d * np.float32(s)


# ---- row-range kernels ----------------------------------------------------------------------
# out[k, c0 + r - r0] for rows r in [r0, r1) of w: the sum over blocks of (weight scale * xd) *
# integer dot, in 16 float lanes on the stack (promoted to a register), plus the weight's min times
# the block sum of x where the format has one. They take whole 2-D arrays and byte offsets, not
# row views: a view per row costs a reference-count round trip, as much as the row's math.


@njit(cache=True, inline="always")
def _zero(acc: np.ndarray) -> None:
    for j in range(16):
        acc[j] = 0.0


@njit(cache=True, inline="always")
def _f16(w: np.ndarray, r: int, o: int) -> np.float32:
    """The little-endian f16 at byte `o` of row r of `w`, as float32 (converted by the CPU; the
    256 KiB lookup table the exact kernels use competes with the weights for cache)."""
    return f16_at(w, r * w.strides[0] + o)


@njit(cache=True, inline="always")
def _u32(w: np.ndarray, r: int, o: int) -> np.uint32:
    """The little-endian u32 at byte `o` of row r of `w`."""
    return (
        np.uint32(w[r, o])
        | (np.uint32(w[r, o + 1]) << np.uint32(8))
        | (np.uint32(w[r, o + 2]) << np.uint32(16))
        | (np.uint32(w[r, o + 3]) << np.uint32(24))
    )


@njit(cache=True)
def qdot_q8_0(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201, ARG001
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            for b in range(xq.shape[1] // 32):
                o = b * 34
                dot_i8x32(accp, _f16(w, r, o) * xd[k, b], w, wr + o + 2, xq, xk + b * 32)
            out[k, c0 + r - r0] = hsum16(accp)


@njit(cache=True)
def qdot_q4_0(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201, ARG001
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            for b in range(xq.shape[1] // 32):
                o = b * 18
                dot_nib16(accp, _f16(w, r, o) * xd[k, b], w, wr + o + 2, 0, 8, xq, xk + b * 32)
            out[k, c0 + r - r0] = hsum16(accp)


@njit(cache=True)
def qdot_q4_1(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            mins = np.float32(0.0)
            for b in range(xq.shape[1] // 32):
                o = b * 20
                dot_nib16(accp, _f16(w, r, o) * xd[k, b], w, wr + o + 4, 0, 0, xq, xk + b * 32)
                mins += _f16(w, r, o + 2) * xs[k, b]
            out[k, c0 + r - r0] = hsum16(accp) + mins


@njit(cache=True)
def qdot_q5_0(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201, ARG001
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            for b in range(xq.shape[1] // 32):
                o = b * 22
                d = _f16(w, r, o) * xd[k, b]
                dot_nib16(accp, d, w, wr + o + 6, _u32(w, r, o + 2), 16, xq, xk + b * 32)
            out[k, c0 + r - r0] = hsum16(accp)


@njit(cache=True)
def qdot_q5_1(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            mins = np.float32(0.0)
            for b in range(xq.shape[1] // 32):
                o = b * 24
                d = _f16(w, r, o) * xd[k, b]
                dot_nib16(accp, d, w, wr + o + 8, _u32(w, r, o + 4), 0, xq, xk + b * 32)
                mins += _f16(w, r, o + 2) * xs[k, b]
            out[k, c0 + r - r0] = hsum16(accp) + mins


@njit(cache=True, inline="always")
def _scale_min_k4(w: np.ndarray, r: int, o: int, j: int) -> tuple[np.float32, np.float32]:
    """Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes at `o` (as k_quants)."""
    if j < 4:
        sc = np.int32(w[r, o + j] & 63)
        m = np.int32(w[r, o + j + 4] & 63)
    else:
        sc = np.int32((w[r, o + j + 4] & 15) | ((w[r, o + j - 4] >> 6) << 4))
        m = np.int32((w[r, o + j + 4] >> 4) | ((w[r, o + j] >> 6) << 4))
    return np.float32(sc), np.float32(m)


@njit(cache=True)
def qdot_q4_k(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            mins = np.float32(0.0)
            for sb in range(xq.shape[1] // QK):
                o = sb * 144
                d = _f16(w, r, o)
                dmin = _f16(w, r, o + 2)
                # Byte g * 32 + j holds sub-block 2g (low nibble) and 2g + 1 (high nibble).
                for g in range(4):
                    sc0, m0 = _scale_min_k4(w, r, o + 4, 2 * g)
                    sc1, m1 = _scale_min_k4(w, r, o + 4, 2 * g + 1)
                    b = sb * 8 + 2 * g
                    qo = wr + o + 16 + g * 32
                    dot_lo32(accp, d * sc0 * xd[k, b], w, qo, xq, xk + b * 32)
                    dot_hi32(accp, d * sc1 * xd[k, b + 1], w, qo, xq, xk + b * 32 + 32)
                    mins += dmin * (m0 * xs[k, b] + m1 * xs[k, b + 1])
            out[k, c0 + r - r0] = hsum16(accp) - mins


@njit(cache=True)
def qdot_q6_k(w, r0, r1, xq, xd, xs, out, c0):  # noqa: ANN001, ANN201, ARG001
    accp = stack_f32(16)
    acc = carray(accp, 16)
    for r in range(r0, r1):
        wr = r * w.strides[0]
        for k in range(xq.shape[0]):
            xk = k * xq.strides[0]
            _zero(acc)
            for sb in range(xq.shape[1] // QK):
                o = sb * 210
                d = _f16(w, r, o + 208)
                for h in range(2):
                    for c in range(4):
                        lo = wr + o + h * 64 + (c & 1) * 32
                        ho = wr + o + 128 + h * 32
                        b = sb * 8 + h * 4 + c
                        s = o + 192 + h * 8 + c * 2
                        dx = d * xd[k, b]
                        # The scales are int8: reinterpret the unsigned bytes.
                        s0 = np.float32((np.int32(w[r, s]) ^ 128) - 128)
                        s1 = np.float32((np.int32(w[r, s + 1]) ^ 128) - 128)
                        ls = 4 * (c >> 1)
                        xo = xk + b * 32
                        dot_q6x16(accp, dx * s0, w, lo, ho, ls, 2 * c, xq, xo)
                        dot_q6x16(accp, dx * s1, w, lo + 16, ho + 16, ls, 2 * c, xq, xo + 16)
            out[k, c0 + r - r0] = hsum16(accp)
