"""Int8 GEMM building blocks for prefill: many activation rows against each weight block, the weight
block unpacked once.

The decode kernels (int8_dots) unpack a weight block for every activation row they meet it with;
at 64-128 rows that unpacking costs more than dequantizing the weight once and calling BLAS. Here
each format's `unpack` (prima.kernels.formats) turns a tile of weight rows into plain bytes plus
an affine map per 16 elements:

    w[j] = sc[j // 16] * u[j] + mn[j // 16]      u uint8, sc and mn float32

and the activations, quantized to int8 per 32-element block as at decode (value = xd * xq), are
packed so that one vector holds 4 consecutive elements of each of GROUP rows (8 rows in 32 bytes;
16 in 64 where the CPU has 512-bit vpdpbusd). A step then broadcasts 4 bytes of u to all lanes
and adds the 4 products into each row's int32 lane (vpdpbusd where the CPU has VNNI; pmaddubsw
and pmaddwd where it has AVX2 alone; else generic vector code numba's LLVM lowers for the host):
GROUP rows x 4 elements per instruction, no horizontal sums. Per 16 elements

    sum_j w[j] x[j] = sc * xd * (integer dot of u and xq) + mn * (xd * sum of xq)

so the mins and offsets of the formats meet the half-block sums of the activations (xs16).

  pack_group(x, g, xt, xdt, xst)       rows of x (n, cols) f32 -> one packed int8 group, scales, sums
  tile_product_for(unpack_max, unpack_piece)
                                       the product of a tile of unpacked weight rows and the
                                       packed activations, for a format's bytes and maps
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from prima.kernels.int8_dots import AVX2, QK8, VNNI, _i64, _x86
from prima.kernels.lanes import stack_f32


def _host_has_vnni512() -> bool:
    """`vpdpbusd` on 512-bit vectors (AVX-512 VNNI): 16 activation rows per instruction. Even on a
    CPU that splits a 512-bit operation into two 256-bit halves, half as many
    broadcasts, loads and instructions per product leave the GEMM less bound by instruction issue."""
    if not VNNI:
        return False
    f = llvm.get_host_cpu_features()
    return bool(f.get("avx512vnni") and f.get("avx512bw") and f.get("avx512f"))


VNNI512 = _host_has_vnni512()
# Activation rows per packed group: one int32 or float32 lane each in a 256-bit vector, or in a
# 512-bit one where the CPU has 512-bit vpdpbusd. Each row's lane sees the same operations in the
# same order either way, so both give the same bits.
GROUP = 16 if VNNI512 else 8
# Bytes of activations one step's vector holds: 4 consecutive elements of each row.
STEP_BYTES = 4 * GROUP
# Elements per affine piece of an unpacked weight row (Q6_K's and Q3_K's scale granularity).
PIECE = 16
# Bytes of one packed activation block: QK8 elements of GROUP rows.
PACKED_BLOCK = QK8 * GROUP
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


@njit(cache=True, inline="always")
def pack_group(x: np.ndarray, g: int, xt: np.ndarray, xdt: np.ndarray, xst: np.ndarray) -> None:
    """Rows [GROUP g, GROUP g + GROUP) of x (n, cols) f32, quantized as int8_dots.quantize_rows
    does (xd = max |x| / 127 per 32-element block, xq = x / xd rounded), packed (rows past n are
    zeros): xt[g, PACKED_BLOCK b + STEP_BYTES t + 4 l + e] = xq[GROUP g + l, 32 b + 4 t + e],
    xdt[g, GROUP b + l] = xd and xst[g, 2 GROUP b + GROUP h + l] = xd * (sum of xq, half h)."""
    n, cols = x.shape
    nb = cols // QK8
    for lane in range(GROUP):
        k = g * GROUP + lane
        for b in range(nb):
            xb = b * PACKED_BLOCK + lane * 4
            if k >= n:
                xdt[g, b * GROUP + lane] = 0.0
                xst[g, b * 2 * GROUP + lane] = 0.0
                xst[g, b * 2 * GROUP + GROUP + lane] = 0.0
                for j in range(QK8):
                    xt[g, xb + (j // 4) * STEP_BYTES + (j % 4)] = 0
                continue
            amax = np.float32(0.0)
            for j in range(QK8):
                amax = max(amax, abs(x[k, b * QK8 + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s0 = 0
            s1 = 0
            for j in range(QK8):
                q = np.int8(np.rint(x[k, b * QK8 + j] * inv))
                xt[g, xb + (j // 4) * STEP_BYTES + (j % 4)] = q
                if j < QK8 // 2:
                    s0 += q
                else:
                    s1 += q
            xdt[g, b * GROUP + lane] = d
            xst[g, b * 2 * GROUP + lane] = d * np.float32(s0)
            xst[g, b * 2 * GROUP + GROUP + lane] = d * np.float32(s1)


def _ptr(context, builder, aryty, ary, off, ty):
    """A `ty` pointer to byte `off` of the contiguous array `ary`."""
    data = context.make_array(aryty)(context, builder, ary).data
    base = builder.bitcast(data, _I8.as_pointer())
    return builder.bitcast(builder.gep(base, [off]), ty.as_pointer())


def _splat_u4(builder, u4):
    """<GROUP x i32> with every lane the 4 weight bytes u4 (one i32)."""
    i32xg = ir.VectorType(_I32, GROUP)
    splat = builder.insert_element(ir.Constant(i32xg, ir.Undefined), u4, ir.Constant(_I32, 0))
    return builder.shuffle_vector(
        splat, ir.Constant(i32xg, ir.Undefined), ir.Constant(ir.VectorType(_I32, GROUP), [0] * GROUP)
    )


def _dot4(builder, acc, u4, xv):
    """acc (GROUP x i32) + per lane l: sum over e < 4 of u4[e] * xv[4 l + e], for u4 the 4 weight
    bytes (unsigned, as one i32) and xv STEP_BYTES activation bytes (signed)."""
    i32x8 = ir.VectorType(_I32, GROUP)
    splat = _splat_u4(builder, u4)
    if VNNI:
        name = f"llvm.x86.avx512.vpdpbusd.{32 * GROUP}"
        return _x86(builder, name, i32x8, acc, splat, builder.bitcast(xv, i32x8))
    # Generic: u8 x s8 products fit int16 (255 * 128), summed in int32 by neighbouring pairs.
    i8x32 = ir.VectorType(_I8, 32)
    i16x32 = ir.VectorType(_I16, 32)
    prod = builder.mul(builder.zext(builder.bitcast(splat, i8x32), i16x32), builder.sext(xv, i16x32))
    i32x32 = ir.VectorType(_I32, 32)
    wide = builder.sext(prod, i32x32)
    even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
    odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
    pairs = builder.add(builder.shuffle_vector(wide, wide, even), builder.shuffle_vector(wide, wide, odd))
    even8 = ir.Constant(i32x8, list(range(0, 16, 2)))
    odd8 = ir.Constant(i32x8, list(range(1, 16, 2)))
    quads = builder.add(
        builder.shuffle_vector(pairs, pairs, even8), builder.shuffle_vector(pairs, pairs, odd8)
    )
    return builder.add(acc, quads)


# ---- AVX2 without vpdpbusd -------------------------------------------------------------------
# pmaddubsw multiplies u8 x s8 and adds neighbouring products into int16 lanes; pmaddwd against
# ones then adds those pairs into the int32 lanes vpdpbusd would have filled. A pair is at most
# 2 * umax * 127, so products of several steps can first be added in int16 (one pmaddwd for a
# run of them): a whole block of nibbles, 4 steps of 5-bit values, 2 of 6-bit ones. Integer sums
# are exact, so the result has VNNI's bits. Bytes above 128 (Q8_0's q + 128) could saturate a
# pair: those run signed, q = u - 128 as pmaddubsw(|q|, x with q's sign), and the map's offset
# takes the 128 back (mn + 128 sc).
WIDE = 0  # int16 run length meaning "bytes above 128: signed steps"
_I16_MAX = 32767


def i16_run(unpack_max: int, steps: int) -> int:
    """How many of `steps` consecutive steps' pmaddubsw sums add up in int16 for bytes up to
    unpack_max (a power of two, at most `steps`), or WIDE where one pair could already saturate."""
    if unpack_max > 128:
        return WIDE
    run = 1
    while run * 2 <= steps and run * 2 * (2 * unpack_max * 127) <= _I16_MAX:
        run *= 2
    return run


def _pairs_avx2(builder, u4, xv, wide):
    """<16 x i16>: per lane l, u4[0] xv[4l] + u4[1] xv[4l+1] and u4[2] xv[4l+2] + u4[3] xv[4l+3]
    (pmaddubsw); `wide`: with q = u4 - 128 per byte in place of u4."""
    i8x32 = ir.VectorType(_I8, 32)
    i16x16 = ir.VectorType(_I16, 16)
    u = builder.bitcast(_splat_u4(builder, u4), i8x32)
    if wide:
        q = builder.xor(u, ir.Constant(i8x32, [-128] * 32))
        absq = builder.call(
            cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i8x32, [i8x32, ir.IntType(1)]), "llvm.abs.v32i8"
            ),
            [q, ir.Constant(ir.IntType(1), 0)],
        )
        return _x86(
            builder,
            "llvm.x86.avx2.pmadd.ub.sw",
            i16x16,
            absq,
            _x86(builder, "llvm.x86.avx2.psign.b", i8x32, xv, q),
        )
    return _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16, u, xv)


def _widen_avx2(builder, pairs):
    """<8 x i32> sums of neighbouring int16 lanes (pmaddwd against ones)."""
    ones = ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), pairs, ones)


def _steps_avx2(builder, u4s, xvs, run):
    """<8 x i32>: the integer dots of consecutive steps (weights u4s, activations xvs), their
    pmaddubsw sums added in int16 `run` at a time (WIDE: signed steps, one at a time)."""
    pairs = [_pairs_avx2(builder, u, x, run == WIDE) for u, x in zip(u4s, xvs, strict=True)]
    run = max(run, 1)
    groups = []
    for g in range(0, len(pairs), run):
        part = pairs[g : g + run]
        while len(part) > 1:
            part = [builder.add(part[k], part[k + 1]) for k in range(0, len(part), 2)]
        groups.append(_widen_avx2(builder, part[0]))
    while len(groups) > 1:
        groups = [builder.add(groups[k], groups[k + 1]) for k in range(0, len(groups), 2)]
    return groups[0]


def _splat_f(builder, value):
    fty = ir.VectorType(_F32, GROUP)
    v = builder.insert_element(ir.Constant(fty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(
        v, ir.Constant(fty, ir.Undefined), ir.Constant(ir.VectorType(_I32, GROUP), [0] * GROUP)
    )


# The AVX2 steps (pmaddubsw) where the CPU has AVX2 but no vpdpbusd; elsewhere (VNNI, or generic
# vector code) every unpack_max compiles to the same step.
PMADDUBSW = AVX2 and not VNNI
STEPS_PER_BLOCK = QK8 // 4


def _gemm_step(split: bool, run: int):
    """The intrinsic gemm_step: one weight block against one packed activation group, into GROUP
    float lanes (one per activation row),

        acc += (s0 * xd) * dot(u[uo:uo+16], xq half 0) + (s1 * xd) * dot(u[uo+16:uo+32], xq half 1)
        accm += m0 * xs half 0 + m1 * xs half 1

    with xt's block at byte xo, xd at element xdo of xdt and the half sums at element xso of xst
    (pack_group's layout). split: the two halves have their own sc and mn, as Q6_K's; else they
    share them (s0 == s1, m0 == m1: one conversion and one multiply-add fewer). run: the AVX2
    steps' int16 run length (i16_run), 1 where PMADDUBSW is false."""

    @intrinsic
    def step(typingctx, acc, accm, u, uo, xt, xo, xdt, xdo, xst, xso, s0, s1, m0, m1):
        def codegen(context, builder, sig, args):
            u4s, xvs = _block_steps(context, builder, sig.args, args)
            sums = _block_sums(builder, u4s, xvs, split, run)
            xd, xs0, xs1 = _activation_scales(context, builder, sig.args, args)
            _accumulate(builder, args, sums, xd, xs0, xs1, split, run)

        f32 = types.float32
        return types.void(acc, accm, u, uo, xt, xo, xdt, xdo, xst, xso, f32, f32, f32, f32), codegen

    return step


def _block_steps(context, builder, a, args):
    """gemm_step's block as STEPS_PER_BLOCK steps: per step 4 weight bytes (one i32, from byte
    uo + 4 t of u) and STEP_BYTES activation bytes (from byte xo + STEP_BYTES t of xt)."""
    i8xs = ir.VectorType(_I8, STEP_BYTES)
    uo = _i64(builder, args[3], a[3])
    xo = _i64(builder, args[5], a[5])
    u4s = []
    xvs = []
    for t in range(STEPS_PER_BLOCK):
        off_u = builder.add(uo, ir.Constant(uo.type, 4 * t))
        u4s.append(builder.load(_ptr(context, builder, a[2], args[2], off_u, _I32), align=1))
        off_x = builder.add(xo, ir.Constant(xo.type, STEP_BYTES * t))
        xvs.append(builder.load(_ptr(context, builder, a[4], args[4], off_x, i8xs), align=1))
    return u4s, xvs


def _block_sums(builder, u4s, xvs, split: bool, run: int):
    """The block's integer dots, <GROUP x i32> each: one per half (split) or one for the block."""
    if PMADDUBSW:
        if split:
            half = STEPS_PER_BLOCK // 2
            return [
                _steps_avx2(builder, u4s[:half], xvs[:half], run),
                _steps_avx2(builder, u4s[half:], xvs[half:], run),
            ]
        return [_steps_avx2(builder, u4s, xvs, run)]
    # Four chains of two steps (two per half), so consecutive steps do not wait on each other.
    chains = []
    for c in range(4):
        part = ir.Constant(ir.VectorType(_I32, GROUP), [0] * GROUP)
        for s in range(2):
            part = _dot4(builder, part, u4s[2 * c + s], xvs[2 * c + s])
        chains.append(part)
    if split:
        return [builder.add(chains[0], chains[1]), builder.add(chains[2], chains[3])]
    return [builder.add(builder.add(chains[0], chains[1]), builder.add(chains[2], chains[3]))]


def _activation_scales(context, builder, a, args):
    """The packed group's xd and its two half sums xs0, xs1 for the block (GROUP float lanes
    each, at elements xdo of xdt and xso of xst)."""
    f32xg = ir.VectorType(_F32, GROUP)
    i64 = ir.IntType(64)
    xdo = builder.mul(_i64(builder, args[7], a[7]), ir.Constant(i64, 4))
    xd = builder.load(_ptr(context, builder, a[6], args[6], xdo, f32xg), align=4)
    xso = builder.mul(_i64(builder, args[9], a[9]), ir.Constant(i64, 4))
    xs0 = builder.load(_ptr(context, builder, a[8], args[8], xso, f32xg), align=4)
    xso1 = builder.add(xso, ir.Constant(i64, 4 * GROUP))
    xs1 = builder.load(_ptr(context, builder, a[8], args[8], xso1, f32xg), align=4)
    return xd, xs0, xs1


def _accumulate(builder, args, sums, xd, xs0, xs1, split: bool, run: int) -> None:
    """acc += each sum times its scale times xd; accm += each offset times its half sum (one
    product of the shared offset and both halves' sum where the halves share their map)."""
    f32xg = ir.VectorType(_F32, GROUP)
    fmuladd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(f32xg, [f32xg, f32xg, f32xg]), f"llvm.fmuladd.v{GROUP}f32"
    )
    scales = [args[10], args[11]]
    offsets = [args[12], args[13]]
    if run == WIDE:
        # The signed steps summed q = u - 128: the offset takes the 128 u's had back.
        c128 = ir.Constant(_F32, 128.0)
        offsets = [
            builder.call(_fmuladd_f32(builder), [c128, s, m]) for s, m in zip(scales, offsets, strict=True)
        ]
    accp = builder.bitcast(args[0], f32xg.as_pointer())
    accmp = builder.bitcast(args[1], f32xg.as_pointer())
    v = builder.load(accp, align=4)
    m = builder.load(accmp, align=4)
    if split:
        for h in range(2):
            scale = builder.fmul(_splat_f(builder, scales[h]), xd)
            v = builder.call(fmuladd, [builder.sitofp(sums[h], f32xg), scale, v])
        m = builder.call(fmuladd, [_splat_f(builder, offsets[0]), xs0, m])
        m = builder.call(fmuladd, [_splat_f(builder, offsets[1]), xs1, m])
    else:
        scale = builder.fmul(_splat_f(builder, scales[0]), xd)
        v = builder.call(fmuladd, [builder.sitofp(sums[0], f32xg), scale, v])
        m = builder.call(fmuladd, [_splat_f(builder, offsets[0]), builder.fadd(xs0, xs1), m])
    builder.store(v, accp, align=4)
    builder.store(m, accmp, align=4)


def _fmuladd_f32(builder):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F32, [_F32, _F32, _F32]), "llvm.fmuladd.f32"
    )


def _tile_product(step):
    """tile_product over the step `step` (split or joint), uncompiled."""

    @njit(cache=True, inline="always")
    def row_step(acc, accm, u, sc, mn, i, b, xt, xo, xdt, xd, xst, xs) -> None:
        """`step` for block b of unpacked row i."""
        s = 2 * b
        step(
            acc,
            accm,
            u,
            i * u.strides[0] + b * QK8,
            xt,
            xo,
            xdt,
            xd,
            xst,
            xs,
            sc[i, s],
            sc[i, s + 1],
            mn[i, s],
            mn[i, s + 1],
        )

    def tile_product(
        u: np.ndarray,
        sc: np.ndarray,
        mn: np.ndarray,
        m: int,
        xt: np.ndarray,
        xdt: np.ndarray,
        xst: np.ndarray,
        n: int,
        out: np.ndarray,
        c0: int,
    ) -> None:
        """out[k, c0 + i] = x_k . w_i for the first m unpacked weight rows (u, sc, mn) and the n
        packed activation rows: four weight rows at a time, so each activation vector loaded serves
        four rows and the four rows' chains of adds run side by side."""
        nb = u.shape[1] // QK8
        a0, a1, a2, a3 = stack_f32(GROUP), stack_f32(GROUP), stack_f32(GROUP), stack_f32(GROUP)
        m0, m1, m2, m3 = stack_f32(GROUP), stack_f32(GROUP), stack_f32(GROUP), stack_f32(GROUP)
        accs = (a0, a1, a2, a3)
        mins = (m0, m1, m2, m3)
        for g in range(xt.shape[0]):
            xg = g * xt.strides[0]
            dg = g * nb * GROUP
            lanes = min(GROUP, n - g * GROUP)
            for i0 in range(0, m, 4):
                # Rows past m repeat the last one (computed, not stored).
                i1 = min(i0 + 1, m - 1)
                i2 = min(i0 + 2, m - 1)
                i3 = min(i0 + 3, m - 1)
                for p in accs:
                    _zero(p)
                for p in mins:
                    _zero(p)
                for b in range(nb):
                    xo = xg + b * PACKED_BLOCK
                    xd = dg + b * GROUP
                    xs = 2 * dg + b * 2 * GROUP
                    row_step(a0, m0, u, sc, mn, i0, b, xt, xo, xdt, xd, xst, xs)
                    row_step(a1, m1, u, sc, mn, i1, b, xt, xo, xdt, xd, xst, xs)
                    row_step(a2, m2, u, sc, mn, i2, b, xt, xo, xdt, xd, xst, xs)
                    row_step(a3, m3, u, sc, mn, i3, b, xt, xo, xdt, xd, xst, xs)
                for q in range(min(4, m - i0)):
                    av = carray(accs[q], GROUP)
                    mv = carray(mins[q], GROUP)
                    for lane in range(lanes):
                        out[g * GROUP + lane, c0 + i0 + q] = av[lane] + mv[lane]

    return tile_product


_TILE_PRODUCTS: dict[tuple[bool, int], object] = {}


def tile_product_for(unpack_max: int, unpack_piece: int):
    """tile_product(u, sc, mn, m, xt, xdt, xst, n, out, c0) for a format whose unpacked bytes go up
    to unpack_max with one affine map per unpack_piece elements: out[k, c0 + i] = x_k . w_i for the
    first m unpacked weight rows and the n packed activation rows. Formats whose steps compile
    alike share one function."""
    split = unpack_piece < QK8
    run = i16_run(unpack_max, STEPS_PER_BLOCK // 2 if split else STEPS_PER_BLOCK) if PMADDUBSW else 1
    key = (split, run)
    if key not in _TILE_PRODUCTS:
        _TILE_PRODUCTS[key] = njit(cache=True)(_tile_product(_gemm_step(split, run)))
    return _TILE_PRODUCTS[key]


@njit(cache=True, inline="always")
def _zero(p) -> None:
    v = carray(p, GROUP)
    for j in range(GROUP):
        v[j] = 0.0
