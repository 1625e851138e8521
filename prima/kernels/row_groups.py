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
  superblock_rows(layout, step, ...)  a K-quant's qdot from its per-super-block step (row by row)
Each returns the kernel uncompiled (the format module compiles it with its own steps).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from prima.kernels.formats import Layout
from prima.kernels.int8_dots import (
    CACHE_LINE,
    PREFETCH_AHEAD,
    QK8,
    affine_scales4,
    half_at,
    hsum,
    prefetch,
    zero_lanes,
)
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


def superblock_rows(layout: Layout, superblock, prefetched: bool):
    """The qdot kernel of a K-quant (256-element super-blocks) from its per-super-block step
        superblock(acc0p, acc1p, w, r, wr, sb, xq, xd, xs, k, xk, less) -> float32
    which adds super-block sb's sub-block dots with activation row k to the lanes at acc0p and
    acc1p (alternating) and returns `less` plus its part of the term subtracted at the end (the
    mins times the blocks' sums, added one by one to the row's running sum; a format without
    mins returns `less`). `prefetched`: ask for each super-block's lines a page ahead.

    Rows go one at a time: taking two activation rows per pass over a super-block, as the
    legacy formats do, gained nothing here (LLVM did not share the unpacking; Q4_K and Q6_K,
    machine C, 2026-12-06), and the prefetch pays for Q6_K but costs Q4_K a few percent."""
    size, elements = layout.nbytes, layout.elements

    def kernel(w, r0, r1, xq, xd, xs, out, c0):
        acc0p, acc1p = stack_f32(16), stack_f32(16)
        n_super = xq.shape[1] // elements
        for r in range(r0, r1):
            wr = r * w.strides[0]
            for k in range(xq.shape[0]):
                xk = k * xq.strides[0]
                zero_lanes(carray(acc0p, 16))
                zero_lanes(carray(acc1p, 16))
                less = np.float32(0.0)
                for sb in range(n_super):
                    if prefetched:
                        ahead = wr + sb * size + PREFETCH_AHEAD
                        for line in range(0, size, CACHE_LINE):
                            prefetch(w, ahead + line)
                    less = superblock(acc0p, acc1p, w, r, wr, sb, xq, xd, xs, k, xk, less)
                out[k, c0 + r - r0] = (hsum(acc0p) + hsum(acc1p)) - less

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
    if layout.offset("m") != layout.offset("d") + 2:
        raise ValueError(f"{layout.qtype.name}: m must follow d")
    four_rows, two_rows, one_row = _affine_row_groups(layout, block_dot)

    def kernel(w, r0, r1, xq, xd, xs, out, c0):
        # Each activation row's accumulators (acc0p, acc1p, accmp): two alternating 16-lane
        # ones and the m terms' 4 lanes.
        row0 = (stack_f32(16), stack_f32(16), stack_f32(4))
        row1 = (stack_f32(16), stack_f32(16), stack_f32(4))
        row2 = (stack_f32(16), stack_f32(16), stack_f32(4))
        row3 = (stack_f32(16), stack_f32(16), stack_f32(4))
        n = xq.shape[0]
        for r in range(r0, r1):
            wr = r * w.strides[0]
            col = c0 + r - r0
            k = 0
            while k + 4 <= n:
                four_rows(row0, row1, row2, row3, w, r, wr, xq, xd, xs, k, out, col)
                k += 4
            while k + 2 <= n:
                two_rows(row0, row1, w, r, wr, xq, xd, xs, k, out, col)
                k += 2
            if k < n:
                one_row(row0, w, r, wr, xq, xd, xs, k, out, col)

    return kernel


def _affine_row_groups(layout: Layout, block_dot):
    """affine_rows's passes over weight row r for four, two and one activation rows from k,
        four_rows(row0, row1, row2, row3, w, r, wr, xq, xd, xs, k, out, col)
    each writing out[k + i, col] for row i, activation row k + i's accumulators (acc0p, acc1p,
    accmp). Within a pass the rows take each block of four in turn, so after inlining they read
    the same weight bytes back to back."""
    four, one = _affine_block_steps(layout, block_dot)
    size = layout.nbytes

    @njit(inline="always")
    def four_rows(row0, row1, row2, row3, w, r, wr, xq, xd, xs, k, out, col):
        _zero_row(row0)
        _zero_row(row1)
        _zero_row(row2)
        _zero_row(row3)
        nb = xq.shape[1] // QK8
        b = 0
        while b + 4 <= nb:
            o = b * size
            _prefetch_four(w, wr + o)
            four(row0, w, r, wr, o, xq, xd, xs, k, b)
            four(row1, w, r, wr, o, xq, xd, xs, k + 1, b)
            four(row2, w, r, wr, o, xq, xd, xs, k + 2, b)
            four(row3, w, r, wr, o, xq, xd, xs, k + 3, b)
            b += 4
        t0 = t1 = t2 = t3 = np.float32(0.0)
        while b < nb:
            o = b * size
            t0 += one(row0, w, r, wr, o, xq, xd, xs, k, b)
            t1 += one(row1, w, r, wr, o, xq, xd, xs, k + 1, b)
            t2 += one(row2, w, r, wr, o, xq, xd, xs, k + 2, b)
            t3 += one(row3, w, r, wr, o, xq, xd, xs, k + 3, b)
            b += 1
        out[k, col] = _affine_total(row0, t0)
        out[k + 1, col] = _affine_total(row1, t1)
        out[k + 2, col] = _affine_total(row2, t2)
        out[k + 3, col] = _affine_total(row3, t3)

    @njit(inline="always")
    def two_rows(row0, row1, w, r, wr, xq, xd, xs, k, out, col):
        _zero_row(row0)
        _zero_row(row1)
        nb = xq.shape[1] // QK8
        b = 0
        while b + 4 <= nb:
            o = b * size
            _prefetch_four(w, wr + o)
            four(row0, w, r, wr, o, xq, xd, xs, k, b)
            four(row1, w, r, wr, o, xq, xd, xs, k + 1, b)
            b += 4
        t0 = t1 = np.float32(0.0)
        while b < nb:
            o = b * size
            t0 += one(row0, w, r, wr, o, xq, xd, xs, k, b)
            t1 += one(row1, w, r, wr, o, xq, xd, xs, k + 1, b)
            b += 1
        out[k, col] = _affine_total(row0, t0)
        out[k + 1, col] = _affine_total(row1, t1)

    @njit(inline="always")
    def one_row(row0, w, r, wr, xq, xd, xs, k, out, col):
        _zero_row(row0)
        nb = xq.shape[1] // QK8
        b = 0
        while b + 4 <= nb:
            o = b * size
            _prefetch_four(w, wr + o)
            four(row0, w, r, wr, o, xq, xd, xs, k, b)
            b += 4
        t0 = np.float32(0.0)
        while b < nb:
            o = b * size
            t0 += one(row0, w, r, wr, o, xq, xd, xs, k, b)
            b += 1
        out[k, col] = _affine_total(row0, t0)

    return four_rows, two_rows, one_row


def _affine_block_steps(layout: Layout, block_dot):
    """The steps of one activation row k over the blocks of weight row r (its bytes from wr):
        four(acc, w, r, wr, o, xq, xd, xs, k, b)   blocks b..b+3, from byte o
        one(acc, w, r, wr, o, xq, xd, xs, k, b)    block b alone (the tail), returning its m term
    for acc the row's accumulators (acc0p, acc1p, accmp)."""
    d_at, m_at, size = layout.offset("d"), layout.offset("m"), layout.nbytes

    @njit(inline="always")
    def four(acc, w, r, wr, o, xq, xd, xs, k, b):
        """Blocks b..b+3 alternately into acc0p and acc1p, their m terms into accmp."""
        acc0p, acc1p, accmp = acc
        s0, s1, s2, s3 = affine_scales4(w, wr + o + d_at, size, xd, xs, k * xd.shape[1] + b, accmp)
        xk = k * xq.strides[0] + b * QK8
        block_dot(acc0p, s0, w, r, wr, o, xq, xk)
        block_dot(acc1p, s1, w, r, wr, o + size, xq, xk + QK8)
        block_dot(acc0p, s2, w, r, wr, o + 2 * size, xq, xk + 2 * QK8)
        block_dot(acc1p, s3, w, r, wr, o + 3 * size, xq, xk + 3 * QK8)

    @njit(inline="always")
    def one(acc, w, r, wr, o, xq, xd, xs, k, b):
        acc0p = acc[0]
        block_dot(acc0p, half_at(w, r, o + d_at) * xd[k, b], w, r, wr, o, xq, k * xq.strides[0] + b * QK8)
        return half_at(w, r, o + m_at) * xs[k, b]

    return four, one


@njit(inline="always")
def _prefetch_four(w, at) -> None:
    """The cache lines of the blocks PREFETCH_AHEAD bytes past byte `at` (four blocks span two)."""
    prefetch(w, at + PREFETCH_AHEAD)
    prefetch(w, at + PREFETCH_AHEAD + 64)


@njit(inline="always")
def _zero_row(acc) -> None:
    """Clear a row's accumulators (acc0p, acc1p, accmp) for a pass."""
    acc0p, acc1p, accmp = acc
    zero_lanes(carray(acc0p, 16))
    zero_lanes(carray(acc1p, 16))
    m = carray(accmp, 4)
    for j in range(4):
        m[j] = 0.0


@njit(inline="always")
def _affine_total(acc, t):
    """A row's result: its two lane accumulators, then its m terms (the 4 lanes and the tail's t)."""
    acc0p, acc1p, accmp = acc
    m = carray(accmp, 4)
    ms = (m[0] + m[1]) + (m[2] + m[3])
    return (hsum(acc0p) + hsum(acc1p)) + (ms + t)
