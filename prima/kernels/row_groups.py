"""The q8 kernels of the legacy formats (32-element blocks) for a few activation rows at once:
each weight block is loaded and unpacked once for up to four rows.

Speculative decoding checks its drafts as a few rows (prima.engine.speculative), and continuous
batching steps several sessions' tokens together. Computed row by row, k rows cost nearly k
times one: the weights stay in cache, but their unpacking (nibbles, high bits, scales) is
repeated per row. Here the rows of a group share one pass over the blocks; after inlining, the
group's block dots read the same weight bytes with nothing in between that could change them,
so LLVM loads and unpacks them once.

Each row's sums are formed in exactly the order of the one-row kernel (the same lanes, the same
alternation of two accumulators, the same tail), so a row's result does not depend on the rows
beside it: a draft checked in a group gives the bits decoding gives it alone.

  legacy_rows(layout, block)          a legacy format's qdot from its per-block step
  affine_rows(layout, block_dot)      the same for formats whose blocks begin with d and m, their
                                      four blocks' scales converted together (NATIVE_HALF)
Both return the kernel uncompiled (the format module compiles it with its own steps).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import Layout
from prima.kernels.int8_dots import PREFETCH_AHEAD, QK8, affine_scales4, half_at, hsum, prefetch, zero_lanes
from prima.kernels.lanes import stack_f32


def legacy_rows(layout: Layout, block):
    """The qdot kernel of a legacy format (one scale per 32-element block, so weight block b meets
    activation block b) from its per-block step
        block(accp, w, r, wr, b, xq, xd, xs, k, xk) -> float32
    which adds block b's integer dot to the lanes at accp and returns its scalar term (the min, or
    the offset, times the block sum of x). A row's blocks alternate between two accumulators so
    that consecutive blocks' adds do not wait on each other."""
    if layout.elements != QK8:
        raise ValueError(f"{layout.qtype.name} blocks hold {layout.elements} elements, not {QK8}")

    def kernel(w, r0, r1, xq, xd, xs, out, c0):
        a0, a1, b0, b1 = stack_f32(16), stack_f32(16), stack_f32(16), stack_f32(16)
        nb = xq.shape[1] // QK8
        block_bytes = w.shape[1] // nb
        n = xq.shape[0]
        for r in range(r0, r1):
            wr = r * w.strides[0]
            col = c0 + r - r0
            k = 0
            while k + 2 <= n:
                zero_lanes(carray(a0, 16))
                zero_lanes(carray(a1, 16))
                ta0 = ta1 = np.float32(0.0)
                xa = k * xq.strides[0]
                zero_lanes(carray(b0, 16))
                zero_lanes(carray(b1, 16))
                tb0 = tb1 = np.float32(0.0)
                xb = (k + 1) * xq.strides[0]
                for i in range(nb // 2):
                    b = 2 * i
                    prefetch(w, wr + b * block_bytes + PREFETCH_AHEAD)
                    ta0 += block(a0, w, r, wr, b, xq, xd, xs, k, xa)
                    ta1 += block(a1, w, r, wr, b + 1, xq, xd, xs, k, xa)
                    tb0 += block(b0, w, r, wr, b, xq, xd, xs, k + 1, xb)
                    tb1 += block(b1, w, r, wr, b + 1, xq, xd, xs, k + 1, xb)
                if nb % 2:
                    ta0 += block(a0, w, r, wr, nb - 1, xq, xd, xs, k, xa)
                    tb0 += block(b0, w, r, wr, nb - 1, xq, xd, xs, k + 1, xb)
                out[k, col] = (hsum(a0) + hsum(a1)) + (ta0 + ta1)
                out[k + 1, col] = (hsum(b0) + hsum(b1)) + (tb0 + tb1)
                k += 2
            if k < n:
                zero_lanes(carray(a0, 16))
                zero_lanes(carray(a1, 16))
                ta0 = ta1 = np.float32(0.0)
                xa = k * xq.strides[0]
                for i in range(nb // 2):
                    b = 2 * i
                    prefetch(w, wr + b * block_bytes + PREFETCH_AHEAD)
                    ta0 += block(a0, w, r, wr, b, xq, xd, xs, k, xa)
                    ta1 += block(a1, w, r, wr, b + 1, xq, xd, xs, k, xa)
                if nb % 2:
                    ta0 += block(a0, w, r, wr, nb - 1, xq, xd, xs, k, xa)
                out[k, col] = (hsum(a0) + hsum(a1)) + (ta0 + ta1)

    return kernel


def affine_rows(layout: Layout, block_dot):
    """The qdot kernel of a legacy format whose blocks begin with the halves d and m (value =
    d * q + m: Q4_1, Q5_1), from its integer block dot
        block_dot(accp, scale, w, r, wr, o, xq, xk)
    which adds scale * (the integer dot of the block at byte o of row r with xq from xk) to the
    lanes at accp. Four blocks' d and m are converted and scaled together (affine_scales4) and the
    m terms summed in 4 lanes. Needs NATIVE_HALF. xd, xs C-contiguous, as quantize_rows's callers
    allocate them."""
    if layout.elements != QK8:
        raise ValueError(f"{layout.qtype.name} blocks hold {layout.elements} elements, not {QK8}")
    d_at, m_at, size = layout.offset("d"), layout.offset("m"), layout.nbytes
    if m_at != d_at + 2:
        raise ValueError(f"{layout.qtype.name}: m must follow d")

    @njit(inline="always")
    def four(acc0p, acc1p, accmp, w, r, wr, o, xq, xd, xs, k, b):
        """Blocks b..b+3 of row k: alternately into acc0 and acc1, their m terms into accm."""
        s0, s1, s2, s3 = affine_scales4(w, wr + o + d_at, size, xd, xs, k * xd.shape[1] + b, accmp)
        xk = k * xq.strides[0] + b * QK8
        block_dot(acc0p, s0, w, r, wr, o, xq, xk)
        block_dot(acc1p, s1, w, r, wr, o + size, xq, xk + QK8)
        block_dot(acc0p, s2, w, r, wr, o + 2 * size, xq, xk + 2 * QK8)
        block_dot(acc1p, s3, w, r, wr, o + 3 * size, xq, xk + 3 * QK8)

    @njit(inline="always")
    def one(acc0p, w, r, wr, o, xq, xd, xs, k, b):
        """Block b of row k on its own (the tail): its m term."""
        block_dot(acc0p, half_at(w, r, o + d_at) * xd[k, b], w, r, wr, o, xq, k * xq.strides[0] + b * QK8)
        return half_at(w, r, o + m_at) * xs[k, b]

    def kernel(w, r0, r1, xq, xd, xs, out, c0):
        a0, a1, b0, b1 = stack_f32(16), stack_f32(16), stack_f32(16), stack_f32(16)
        c0p, c1p, d0, d1 = stack_f32(16), stack_f32(16), stack_f32(16), stack_f32(16)
        ma, mb, mc, md = stack_f32(4), stack_f32(4), stack_f32(4), stack_f32(4)
        nb = xq.shape[1] // QK8
        n = xq.shape[0]
        for r in range(r0, r1):
            wr = r * w.strides[0]
            col = c0 + r - r0
            k = 0
            while k + 4 <= n:
                zero_lanes(carray(a0, 16))
                zero_lanes(carray(a1, 16))
                zero_lanes(carray(b0, 16))
                zero_lanes(carray(b1, 16))
                zero_lanes(carray(c0p, 16))
                zero_lanes(carray(c1p, 16))
                zero_lanes(carray(d0, 16))
                zero_lanes(carray(d1, 16))
                _zero4(ma)
                _zero4(mb)
                _zero4(mc)
                _zero4(md)
                b = 0
                while b + 4 <= nb:
                    o = b * size
                    prefetch(w, wr + o + PREFETCH_AHEAD)
                    prefetch(w, wr + o + PREFETCH_AHEAD + 64)
                    four(a0, a1, ma, w, r, wr, o, xq, xd, xs, k, b)
                    four(b0, b1, mb, w, r, wr, o, xq, xd, xs, k + 1, b)
                    four(c0p, c1p, mc, w, r, wr, o, xq, xd, xs, k + 2, b)
                    four(d0, d1, md, w, r, wr, o, xq, xd, xs, k + 3, b)
                    b += 4
                ta = tb = tc = td = np.float32(0.0)
                while b < nb:
                    o = b * size
                    ta += one(a0, w, r, wr, o, xq, xd, xs, k, b)
                    tb += one(b0, w, r, wr, o, xq, xd, xs, k + 1, b)
                    tc += one(c0p, w, r, wr, o, xq, xd, xs, k + 2, b)
                    td += one(d0, w, r, wr, o, xq, xd, xs, k + 3, b)
                    b += 1
                out[k, col] = _affine_total(a0, a1, ma, ta)
                out[k + 1, col] = _affine_total(b0, b1, mb, tb)
                out[k + 2, col] = _affine_total(c0p, c1p, mc, tc)
                out[k + 3, col] = _affine_total(d0, d1, md, td)
                k += 4
            while k + 2 <= n:
                zero_lanes(carray(a0, 16))
                zero_lanes(carray(a1, 16))
                zero_lanes(carray(b0, 16))
                zero_lanes(carray(b1, 16))
                _zero4(ma)
                _zero4(mb)
                b = 0
                while b + 4 <= nb:
                    o = b * size
                    prefetch(w, wr + o + PREFETCH_AHEAD)
                    prefetch(w, wr + o + PREFETCH_AHEAD + 64)
                    four(a0, a1, ma, w, r, wr, o, xq, xd, xs, k, b)
                    four(b0, b1, mb, w, r, wr, o, xq, xd, xs, k + 1, b)
                    b += 4
                ta = tb = np.float32(0.0)
                while b < nb:
                    o = b * size
                    ta += one(a0, w, r, wr, o, xq, xd, xs, k, b)
                    tb += one(b0, w, r, wr, o, xq, xd, xs, k + 1, b)
                    b += 1
                out[k, col] = _affine_total(a0, a1, ma, ta)
                out[k + 1, col] = _affine_total(b0, b1, mb, tb)
                k += 2
            if k < n:
                zero_lanes(carray(a0, 16))
                zero_lanes(carray(a1, 16))
                _zero4(ma)
                b = 0
                while b + 4 <= nb:
                    o = b * size
                    prefetch(w, wr + o + PREFETCH_AHEAD)
                    prefetch(w, wr + o + PREFETCH_AHEAD + 64)
                    four(a0, a1, ma, w, r, wr, o, xq, xd, xs, k, b)
                    b += 4
                ta = np.float32(0.0)
                while b < nb:
                    o = b * size
                    ta += one(a0, w, r, wr, o, xq, xd, xs, k, b)
                    b += 1
                out[k, col] = _affine_total(a0, a1, ma, ta)

    return kernel


@njit(inline="always")
def _zero4(accmp) -> None:
    m = carray(accmp, 4)
    for j in range(4):
        m[j] = 0.0


@njit(inline="always")
def _affine_total(acc0p, acc1p, accmp, t):
    m = carray(accmp, 4)
    ms = (m[0] + m[1]) + (m[2] + m[3])
    return (hsum(acc0p) + hsum(acc1p)) + (ms + t)
