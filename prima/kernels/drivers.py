"""Parallel numba drivers over the per-row kernels of the formats (prima.kernels.formats).

The weight format is a runtime argument (its GGML type id), so one compiled driver serves every
format and one parallel launch can cover several weights of the same format (attn_q, attn_k and
attn_v, or ffn_gate and ffn_up): at decode, launches and Python calls cost as much as the math.
The drivers reach a format's kernels through prima.kernels.dispatch, which is built from the
format table, so they compile once for every format.

  matvec(fmt, a, b, c, x, lut, out)        out (n, ra + rb + rc) = x @ [A; B; C].T
  matvec_q8(fmt, a, b, c, x, out)          the same with x quantized to int8 blocks (int8_dots)
  gemm_q8(fmt, a, b, c, x, out)            matvec_q8 for many rows of x: each weight row unpacked
                                           once for all of them (int8_gemm)
  matvec_f16(a, b, c, x, out)              out (n, ra + rb + rc) = x @ [A; B; C].T, float16 weights
  matvec_f32(a, b, c, x, out)              the same for float32 weights (as uint32 bits)
  dequantize_rows(fmt, a, ids, lut, out)   out (m, cols) = A[ids], parallel over ids
  dequantize_tile(fmt, a, start, lut, out) out (m, cols) = A[start : start + m], one thread, no GIL
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import carray, njit, prange

from prima.kernels import dispatch
from prima.kernels import int8_dots as i8
from prima.kernels import int8_gemm as g8
from prima.kernels.lanes import bits_f32, half_to_f32, stack_f32

# What callers check before a launch: formats with kernels, and those with int8 ones.
QUANTIZED_IDS = dispatch.QUANTIZED_IDS
INT8_IDS = dispatch.INT8_IDS
GEMM_IDS = dispatch.GEMM_IDS
has_int8 = dispatch.has_int8
quantize_rows = i8.quantize_rows
QK8 = i8.QK8  # elements per int8 activation block
VNNI = i8.VNNI  # the int8 dots use vpdpbusd
AVX2 = i8.AVX2  # the int8 dots and GEMM use AVX2's byte products (pmaddubsw, or vpdpbusd)

# gemm_tile(fmt, u, sc, mn, m, xt, xdt, xst, n, out, c0): a tile of unpacked weight rows of
# format fmt against the packed activations, with the GEMM step made for the format's bytes.
gemm_tile = dispatch.switch(
    "gemm_tile",
    ("u", "sc", "mn", "m", "xt", "xdt", "xst", "n", "out", "c0"),
    [
        (q, g8.tile_product_for(f.unpack_max, f.unpack_piece))
        for q, f in dispatch.FORMATS.items()
        if f.unpack is not None
    ],
)

# Rows per parallel work item: fewer scheduling steps, still enough items to balance 2-8 threads.
CHUNK_ROWS = 16


@njit(parallel=True, cache=True)
def matvec(
    fmt: int, a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, lut: np.ndarray, out: np.ndarray
) -> None:
    """out (n, ra + rb + rc) = x @ [A; B; C].T for raw weights A, B, C of format `fmt` sharing
    the input dimension (pass empty row slices for unused slots)."""
    ra = a.shape[0]
    rab = ra + b.shape[0]
    total = rab + c.shape[0]
    n_chunks = (total + CHUNK_ROWS - 1) // CHUNK_ROWS
    for ch in prange(n_chunks):
        for r in range(ch * CHUNK_ROWS, min(total, (ch + 1) * CHUNK_ROWS)):
            if r < ra:
                dispatch.dot(fmt, a[r], x, lut, out, r)
            elif r < rab:
                dispatch.dot(fmt, b[r - ra], x, lut, out, r)
            else:
                dispatch.dot(fmt, c[r - rab], x, lut, out, r)


CACHE_LINE = i8.CACHE_LINE  # a float row's kernels ask for each line a page ahead

HALF_LANES = 32  # float32 accumulators of one row dot over 16-bit float weights
# ... and over float32 weights: at 32, LLVM unrolls a row's lanes into scalars it does not
# vectorize again (at 64 it keeps the loop and vectorizes it).
F32_LANES = 64


@njit(inline="always")
def pairwise_sum(acc: np.ndarray, start: int, lanes: int) -> np.float32:
    """The sum of acc[start : start + lanes] (lanes a power of two), halves added lane by lane
    until one is left: vector adds where a scalar chain of `lanes` adds would cost more than
    the product of a short row."""
    half = lanes // 2
    while half >= 1:
        for j in range(half):
            acc[start + j] += acc[start + j + half]
        half //= 2
    return acc[start]


def row_group(widen: Callable[..., np.float32], rows: int, lanes: int) -> Callable[..., None]:
    """A kernel for `rows` rows of x (x[k : k + rows]) against one weight row w: each weight is
    widened once for all of them, and each row sums in its own `lanes` float32 lanes in the
    order one row alone uses, so a row's bits do not depend on the rows beside it (speculative
    decoding checks its drafts in such groups). The lanes vectorize without reassociating a
    scalar sum."""
    size = lanes * rows

    @njit(inline="always")
    def group_dot(w, x, k, out, r):
        acc = carray(stack_f32(size), size)
        for i in range(size):
            acc[i] = 0.0
        n = w.shape[0]
        full = n - n % lanes
        block_bytes = lanes * w.itemsize
        for b in range(0, full, lanes):
            ahead = b * w.itemsize + i8.PREFETCH_AHEAD
            for line in range(0, block_bytes, CACHE_LINE):
                i8.prefetch(w, ahead + line)
            for j in range(lanes):
                wj = widen(w[b + j])
                for i in range(rows):
                    acc[i * lanes + j] += x[k + i, b + j] * wj
        for i in range(rows):
            s = pairwise_sum(acc, i * lanes, lanes)
            for j in range(full, n):
                s += x[k + i, j] * widen(w[j])
            out[k + i, r] = s

    return group_dot


@njit(inline="always")
def float_matvec(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    four: Callable[..., None],
    two: Callable[..., None],
    one: Callable[..., None],
) -> None:
    """out (n, ra + rb + rc) = x @ [A; B; C].T for float weights A, B, C (pass empty row slices
    for unused slots) viewed as unsigned integers of their width, a few rows of x, by the
    row_group kernels `four`, `two` and `one` of one widening: the weights are read once, as
    stored, not widened to a float32 copy every token, and q/k/v or gate/up take one launch, as
    drivers.matvec does for quantized weights. The rows of x go through in groups of four, then
    two, then one, and every row has the bits it has alone. The entry points below pass their
    groups from module globals: a kernel closing over them would pickle differently in every
    process, and numba's cache would compile it again in each."""
    ra = a.shape[0]
    rab = ra + b.shape[0]
    rows = rab + c.shape[0]
    n = x.shape[0]
    n_chunks = (rows + CHUNK_ROWS - 1) // CHUNK_ROWS
    for ch in prange(n_chunks):
        for r in range(ch * CHUNK_ROWS, min(rows, (ch + 1) * CHUNK_ROWS)):
            if r < ra:
                w = a[r]
            elif r < rab:
                w = b[r - ra]
            else:
                w = c[r - rab]
            k = 0
            while k + 4 <= n:
                four(w, x, k, out, r)
                k += 4
            if k + 2 <= n:
                two(w, x, k, out, r)
                k += 2
            if k < n:
                one(w, x, k, out, r)


# float16 weights (lanes.half_to_f32: the CPU's conversion where it has one).
_F16_FOUR, _F16_TWO, _F16_ONE = (row_group(half_to_f32, rows, HALF_LANES) for rows in (4, 2, 1))
# float32 weights as their bits (lanes.bits_f32).
_F32_FOUR, _F32_TWO, _F32_ONE = (row_group(bits_f32, rows, F32_LANES) for rows in (4, 2, 1))


@njit(parallel=True, cache=True)
def matvec_f16(a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out (n, ra + rb + rc) = x @ [A; B; C].T for float16 weights (uint16 bits, rows x cols)."""
    float_matvec(a, b, c, x, out, _F16_FOUR, _F16_TWO, _F16_ONE)


@njit(parallel=True, cache=True)
def matvec_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out (n, ra + rb + rc) = x @ [A; B; C].T for float32 weights (uint32 bits, rows x cols)."""
    float_matvec(a, b, c, x, out, _F32_FOUR, _F32_TWO, _F32_ONE)


@njit(parallel=True, cache=True)
def matvec_q8(fmt: int, a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """matvec for a format in INT8_IDS with x quantized to int8 blocks first (int8_dots): the
    quantization runs here, in the same call, because at decode a call costs as much as the math."""
    n, cols = x.shape
    xq = np.empty((n, cols), dtype=np.int8)
    xd = np.empty((n, cols // i8.QK8), dtype=np.float32)
    xs = np.empty((n, cols // i8.QK8), dtype=np.float32)
    i8.quantize_rows(x, xq, xd, xs)
    ra = a.shape[0]
    rab = ra + b.shape[0]
    total = rab + c.shape[0]
    n_chunks = (total + CHUNK_ROWS - 1) // CHUNK_ROWS
    for ch in prange(n_chunks):
        start = ch * CHUNK_ROWS
        stop = min(total, start + CHUNK_ROWS)
        # The chunk's rows, split where it crosses from A to B or B to C.
        if start < ra:
            dispatch.qdot(fmt, a, start, min(stop, ra), xq, xd, xs, out, start)
        if start < rab and stop > ra:
            lo = max(start, ra)
            dispatch.qdot(fmt, b, lo - ra, min(stop, rab) - ra, xq, xd, xs, out, lo)
        if stop > rab:
            lo = max(start, rab)
            dispatch.qdot(fmt, c, lo - rab, stop - rab, xq, xd, xs, out, lo)


# Weight rows unpacked per parallel work item: 16 rows of bytes (32 KiB at 2048 columns) stay in
# L1/L2 while every packed activation group passes them.
GEMM_TILE_ROWS = 16


@njit(parallel=True, cache=True)
def gemm_q8(fmt: int, a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out (n, ra + rb + rc) = x @ [A; B; C].T for a format in GEMM_IDS, x quantized to int8
    blocks as matvec_q8 quantizes it: the activations are packed once (int8_gemm.pack_group),
    then each tile of weight rows is unpacked once and meets every activation row."""
    n, cols = x.shape
    nb = cols // i8.QK8
    groups = (n + g8.GROUP - 1) // g8.GROUP
    xt = np.empty((groups, nb * g8.PACKED_BLOCK), dtype=np.int8)
    xdt = np.empty((groups, nb * g8.GROUP), dtype=np.float32)
    xst = np.empty((groups, nb * 2 * g8.GROUP), dtype=np.float32)
    for g in prange(groups):
        g8.pack_group(x, g, xt, xdt, xst)
    ra = a.shape[0]
    rab = ra + b.shape[0]
    total = rab + c.shape[0]
    n_tiles = (total + GEMM_TILE_ROWS - 1) // GEMM_TILE_ROWS
    for t in prange(n_tiles):
        r0 = t * GEMM_TILE_ROWS
        m = min(GEMM_TILE_ROWS, total - r0)
        u = np.empty((GEMM_TILE_ROWS, cols), dtype=np.uint8)
        sc = np.empty((GEMM_TILE_ROWS, cols // g8.PIECE), dtype=np.float32)
        mn = np.empty((GEMM_TILE_ROWS, cols // g8.PIECE), dtype=np.float32)
        for i in range(m):
            r = r0 + i
            if r < ra:
                dispatch.unpack(fmt, a[r], u[i], sc[i], mn[i])
            elif r < rab:
                dispatch.unpack(fmt, b[r - ra], u[i], sc[i], mn[i])
            else:
                dispatch.unpack(fmt, c[r - rab], u[i], sc[i], mn[i])
        gemm_tile(fmt, u, sc, mn, m, xt, xdt, xst, n, out, r0)


@njit(parallel=True, cache=True)
def dequantize_rows(fmt: int, a: np.ndarray, ids: np.ndarray, lut: np.ndarray, out: np.ndarray) -> None:
    """out (m, cols) = rows `ids` of A dequantized."""
    for i in prange(ids.shape[0]):
        dispatch.deq(fmt, a[ids[i]], lut, out[i])


@njit(cache=True, nogil=True)
def dequantize_tile(fmt: int, a: np.ndarray, start: int, lut: np.ndarray, out: np.ndarray) -> None:
    """out (m, cols) = rows [start, start + m) of A dequantized, on the calling thread without
    the GIL (prefill runs one such tile per Python worker thread, next to a BLAS call)."""
    for i in range(out.shape[0]):
        dispatch.deq(fmt, a[start + i], lut, out[i])
