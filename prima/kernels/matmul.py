"""y = x @ W.T and W[ids] straight from raw GGUF blocks, choosing the kernel per tensor format.

Decode (n = 1) and short batches run fused numba kernels that read each weight byte once and
never materialize W. Longer batches (prefill) in int8 mode run the int8 GEMM (drivers.gemm_q8:
each weight row unpacked once for all activation rows) where the CPU has AVX2 (INT8_GEMM).
In exact mode, on other CPUs, or for a format without an unpack step, they dequantize ~1 MiB
tiles of rows and hand them to BLAS, which beats a hand-written float loop once the dequantize
cost is shared by many activation rows. Without numba, the same tiling runs on gguf-py's numpy
dequantizer (slow, but correct)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from threading import local

import numpy as np

from prima.errors import InputError
from prima.ggml_constants import GGMLQuantizationType
from prima.kernels.quants import F16_TABLE, FLOAT_QTYPES, check_supported
from prima.kernels.tensor import QTensor

try:
    from prima.kernels import drivers, float_weights

    HAVE_NUMBA = True
except ImportError:  # numba is optional at runtime: fall back to gguf-py + BLAS
    HAVE_NUMBA = False

Q = GGMLQuantizationType
# Float weights read as stored at decode by row-group kernels (drivers.float_matvec), whose
# rows have the bits of a row alone, as BLAS's do not (it picks another kernel for 4 rows).
FLOAT_ROW_QTYPES = (Q.F32, Q.F16, Q.BF16)

# Up to this many activation rows the fused per-row kernels run; above, the int8 GEMM (int8 mode)
# or dequantized tiles + BLAS.
FUSED_MAX_N = 4
# Whether q8 prefill runs the int8 GEMM: where the CPU has AVX2's byte products (pmaddubsw, or
# vpdpbusd with AVX-512 VNNI or AVX-VNNI), with which it beats dequantized tiles + BLAS. Its
# generic vector code (ARM, a portable build) loses to BLAS, so there prefill keeps BLAS and
# float activations.
INT8_GEMM = HAVE_NUMBA and drivers.AVX2
# Elements per dequantized tile (float32: 1 MiB), small enough to stay in L2 while BLAS reads it.
TILE_ELEMENTS = 1 << 18
# Prefill splits a weight's row tiles over this many Python threads; each dequantizes without the
# GIL and calls single-threaded BLAS, so no two thread pools spin against each other.
_prefill_threads = 1
_pool: ThreadPoolExecutor | None = None
# Each thread's tile array, reused from tile to tile (see _tile_buffer).
_scratch = local()


def set_threads(threads: int) -> None:
    """Use `threads` workers for prefill tiles (decode kernels use numba's pool)."""
    global _prefill_threads
    _prefill_threads = max(1, threads)


def matmul(w: QTensor, x: np.ndarray, int8: bool = False) -> np.ndarray:
    """x (n, cols) -> float32 (n, rows) = x @ dequantize(W).T."""
    return matmul_many((w,), x, int8)


def matmul_many(ws: Sequence[QTensor], x: np.ndarray, int8: bool = False) -> np.ndarray:
    """x (n, cols) -> float32 (n, sum of rows) = x @ [W0; W1; ...].T for weights sharing `cols`.
    Up to three weights of one quantized format run as a single fused launch (q/k/v, gate/up).
    With `int8`, fused launches of formats in drivers.INT8_IDS quantize x to int8 blocks first
    (llama.cpp's decode arithmetic: faster, within activation-quantization error of exact), and
    so do longer batches of formats in drivers.GEMM_IDS where INT8_GEMM (the int8 GEMM)."""
    x = _activations(ws[0], x)
    for w in ws[1:]:
        _activations(w, x)
    n = x.shape[0]
    fmt = int(ws[0].qtype)
    if (
        HAVE_NUMBA
        and len(ws) <= 3
        and fmt in drivers.QUANTIZED_IDS
        and all(w.qtype == ws[0].qtype for w in ws)
        and (n <= FUSED_MAX_N or (int8 and INT8_GEMM and fmt in drivers.GEMM_IDS))
    ):
        out = np.empty((n, sum(w.rows for w in ws)), dtype=np.float32)
        raws = _same_kind([w.raw for w in ws])
        a = raws[0]
        b = raws[1] if len(raws) > 1 else a[:0]
        c = raws[2] if len(raws) > 2 else a[:0]
        if n > FUSED_MAX_N:
            drivers.gemm_q8(fmt, a, b, c, x, out)
        elif int8 and fmt in drivers.INT8_IDS:
            drivers.matvec_q8(fmt, a, b, c, x, out)
        else:
            drivers.matvec(fmt, a, b, c, x, F16_TABLE, out)
        return out
    if HAVE_NUMBA and len(ws) <= 3 and n <= FUSED_MAX_N and all(w.qtype == ws[0].qtype for w in ws):
        if ws[0].qtype in FLOAT_ROW_QTYPES:  # one launch for q/k/v or gate/up, as above
            out = np.empty((n, sum(w.rows for w in ws)), dtype=np.float32)
            _float_matvec(ws, x, out)
            return out
    if len(ws) == 1 and n <= FUSED_MAX_N:
        return _matmul_one(ws[0], x)
    # Each weight's product straight into its columns: no per-weight arrays to concatenate
    # (a prefill's gate|up would hold twice its 1.5 MiB at the peak of its block).
    out = np.empty((n, sum(w.rows for w in ws)), dtype=np.float32)
    if n > FUSED_MAX_N:
        _tiled_products(ws, x, _dequantize_tile if HAVE_NUMBA else _reference_tile, out)
        return out
    col = 0
    for w in ws:
        _matmul_one(w, x, out[:, col : col + w.rows])
        col += w.rows
    return out


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 (n, cols), cols a multiple of 32 -> (int8 (n, cols), scales (n, cols / 32),
    block sums (n, cols / 32)): x ~ scale * int8 per 32-element block (drivers.QK8)."""
    n, cols = x.shape
    xq = np.empty((n, cols), dtype=np.int8)
    xd = np.empty((n, cols // drivers.QK8), dtype=np.float32)
    xs = np.empty((n, cols // drivers.QK8), dtype=np.float32)
    drivers.quantize_rows(x, xq, xd, xs)
    return xq, xd, xs


def _matmul_one(w: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x @ dequantize(W).T for a few rows x (a decode step, a check of drafts), into `out`
    (n, rows) when given (it may be a column slice)."""
    if out is None:
        out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    if not HAVE_NUMBA:
        if w.qtype == Q.F32:
            return np.matmul(x, w.raw.view(np.float32).T, out=out)
        _tiled_products([w], x, _reference_tile, out)
        return out
    if int(w.qtype) in drivers.QUANTIZED_IDS or w.qtype in FLOAT_ROW_QTYPES:
        rows = out if out.flags.c_contiguous else np.empty_like(out)  # the kernel's own C layout
        if w.qtype in FLOAT_ROW_QTYPES:
            _float_matvec([w], x, rows)
        else:
            drivers.matvec(int(w.qtype), w.raw, w.raw[:0], w.raw[:0], x, F16_TABLE, rows)
        if rows is not out:
            out[...] = rows
        return out
    _tiled_products([w], x, _dequantize_tile, out)
    return out


def _float_matvec(ws: Sequence[QTensor], x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ [W0; W1; W2].T for up to three float weights of one type and a few rows x,
    by the row-group kernels in one launch."""
    qtype = ws[0].qtype
    bits = np.uint32 if qtype == Q.F32 else np.uint16
    raws = _same_kind([w.raw.view(bits) for w in ws])
    a = raws[0]
    b = raws[1] if len(raws) > 1 else a[:0]
    c = raws[2] if len(raws) > 2 else a[:0]
    kernel = {Q.F32: drivers.matvec_f32, Q.F16: drivers.matvec_f16}.get(qtype, float_weights.matvec_bf16)
    kernel(a, b, c, x, out)


def _same_kind(raws: list[np.ndarray]) -> list[np.ndarray]:
    """numba compiles one driver per array type: make writable and read-only views agree."""
    if all(r.flags.writeable == raws[0].flags.writeable for r in raws):
        return raws
    views = [r.view() for r in raws]
    for v in views:
        v.flags.writeable = False
    return views


def get_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W dequantized to float32 (len(ids), cols): the embedding lookup."""
    ids = _row_ids(w, ids)
    return _dequantize_rows(w, ids) if HAVE_NUMBA else get_rows_fallback(w, ids)


def matmul_fallback(w: QTensor, x: np.ndarray) -> np.ndarray:
    """matmul without numba: gguf-py dequantizes tiles, BLAS multiplies them."""
    x = _activations(w, x)
    out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    _tiled_products([w], x, _reference_tile, out)
    return out


def get_rows_fallback(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """get_rows without numba, via gguf-py's reference dequantizer."""
    return _reference_rows(w, _row_ids(w, ids))


def _activations(w: QTensor, x: np.ndarray) -> np.ndarray:
    check_supported(w.qtype, w.name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"{w.name}: activations of shape {x.shape} do not match weight {w.shape}")
    return x


def _row_ids(w: QTensor, ids: np.ndarray) -> np.ndarray:
    check_supported(w.qtype, w.name)
    if ids.dtype != np.int64 or ids.ndim != 1 or not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if not _ids_within(ids, w.rows):
        bad = int(ids[(ids < 0) | (ids >= w.rows)][0])
        raise InputError(
            f"{w.name}: row id {bad} is outside [0, {w.rows}); is the token id from another vocabulary?"
        )
    return ids


def _ids_within(ids: np.ndarray, n: int) -> bool:
    """Whether every id is in [0, n). A decode step's one id is checked in Python: it comes
    after the ring's other nodes have had the caches, where each numpy call costs tens of
    microseconds."""
    if ids.size <= FUSED_MAX_N:
        return all(0 <= i < n for i in ids.tolist())
    return bool(ids.min() >= 0 and ids.max() < n)


def _tiled_products(
    ws: Sequence[QTensor],
    x: np.ndarray,
    dequantize: Callable[[QTensor, int, int], np.ndarray],
    out: np.ndarray,
) -> None:
    """out = x @ [W0; W1; ...].T by float32 tiles of rows (`dequantize`), each multiplied by
    single-threaded BLAS into its columns of `out`. The prefill threads take the next tile of
    any weight as they finish one, so unequal weights (q, k and v; a weight of one tile) keep
    both busy. A tile's bounds depend only on its weight's shape, so the bits do not depend on
    the thread count."""
    tiles: list[tuple[QTensor, int, int, int]] = []
    col = 0
    for w in ws:
        tile_rows = _tile_rows(w.rows, w.cols)
        tiles += [(w, start, min(start + tile_rows, w.rows), col) for start in range(0, w.rows, tile_rows)]
        col += w.rows

    def run(tile: tuple[QTensor, int, int, int]) -> None:
        w, start, stop, col = tile
        np.matmul(x, dequantize(w, start, stop).T, out=out[:, col + start : col + stop])

    if _prefill_threads == 1 or len(tiles) == 1:
        for tile in tiles:
            run(tile)
    else:
        list(_thread_pool().map(run, tiles))


def _tile_rows(rows: int, cols: int) -> int:
    """Rows per tile: as few tiles as keep each within TILE_ELEMENTS, all of about one size (a
    576-row weight is two tiles of 288, not 455 and 121, which would leave a thread waiting)."""
    per_tile = max(1, TILE_ELEMENTS // cols)
    tiles = -(-rows // per_tile)
    return -(-rows // tiles)


def prefill_map(fn: Callable[[tuple[int, int]], np.ndarray], n: int) -> list[np.ndarray]:
    """fn over [start, stop) spans splitting range(n) evenly between the prefill threads (numpy
    and BLAS release the GIL), results in span order."""
    parts = min(_prefill_threads, n)
    bounds = [n * i // parts for i in range(parts + 1)]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    if parts <= 1:
        return [fn(spans[0])] if spans else []
    return list(_thread_pool().map(fn, spans))


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < _prefill_threads:
        _pool = ThreadPoolExecutor(max_workers=_prefill_threads, thread_name_prefix="prima-prefill")
    return _pool


def _dequantize_tile(w: QTensor, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of W as float32 on the calling thread (numba kernels, no GIL), in that
    thread's tile buffer: valid until its next tile."""
    if w.qtype == Q.F32:
        return w.raw[start:stop].view(np.float32)  # the mapped rows themselves: no copy
    out = _tile_buffer(stop - start, w.cols)
    if w.qtype == Q.F16:
        float_weights.widen_f16_tile(w.raw.view(np.uint16), start, out)
    elif w.qtype == Q.BF16:
        float_weights.widen_bf16_tile(w.raw.view(np.uint16), start, out)
    else:
        drivers.dequantize_tile(int(w.qtype), w.raw, start, F16_TABLE, out)
    return out


def _tile_buffer(rows: int, cols: int) -> np.ndarray:
    """This thread's float32 (rows, cols) tile, the same memory for every tile it dequantizes:
    glibc hands a freed 1 MiB block back to the OS, so a fresh array per tile came from new
    pages, ~250 page faults each (an F16 prefill of 128 tokens took 25,000 of them)."""
    size = rows * cols
    buf: np.ndarray | None = getattr(_scratch, "tile", None)
    if buf is None or buf.size < size:
        buf = _scratch.tile = np.empty(max(size, TILE_ELEMENTS), dtype=np.float32)
    return buf[:size].reshape(rows, cols)


def _reference_tile(w: QTensor, start: int, stop: int) -> np.ndarray:
    if w.qtype == Q.F32:
        return w.raw[start:stop].view(np.float32)  # as _dequantize_tile: no copy
    return _reference_rows(w, np.arange(start, stop, dtype=np.int64))


def _dequantize_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W as float32, by numba kernel (quantized) or numpy (float formats)."""
    if w.qtype in FLOAT_QTYPES:
        return _float_rows(w, ids)
    out = np.empty((ids.shape[0], w.cols), dtype=np.float32)
    if ids.shape[0] <= FUSED_MAX_N:
        # A decode step's embedding: one row on this thread. A parallel launch for it would wake
        # the thread team, which has slept while the ring computed the last token.
        for i, row in enumerate(ids.tolist()):
            drivers.dequantize_tile(
                int(w.qtype), w.raw, row, F16_TABLE, out if len(out) == 1 else out[i : i + 1]
            )
        return out
    drivers.dequantize_rows(int(w.qtype), w.raw, ids, F16_TABLE, out)
    return out


def _float_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    raw = w.raw[ids]
    if w.qtype == Q.F32:
        return raw.view(np.float32)
    if w.qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32)
    # BF16 is the top half of a float32.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _reference_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    if w.qtype in FLOAT_QTYPES:
        return _float_rows(w, ids)
    from gguf import quants as gguf_quants  # only for formats without kernels of ours: rare

    rows = gguf_quants.dequantize(w.raw[ids], w.qtype)
    return np.asarray(rows, dtype=np.float32).reshape(ids.shape[0], w.cols)
