"""y = x @ W.T and W[ids] straight from raw GGUF blocks, choosing the kernel per tensor format.

Decode (n = 1) and short batches run fused numba kernels that read each weight byte once and
never materialize W. Longer batches (prefill) dequantize ~1 MiB tiles of rows and hand them to
BLAS, which beats a hand-written loop once the dequantize cost is shared by many activation rows.
Without numba, the same tiling runs on gguf-py's numpy dequantizer (slow, but correct)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from prima.errors import InputError
from prima.kernels.quants import F16_TABLE, FLOAT_QTYPES, check_supported
from prima.kernels.tensor import QTensor

try:
    from prima.kernels import k_quants, legacy_quants

    HAVE_NUMBA = True
except ImportError:  # numba is optional at runtime: fall back to gguf-py + BLAS
    HAVE_NUMBA = False

Q = GGMLQuantizationType

# Up to this many activation rows the fused kernels win; above, dequantized tiles + BLAS do.
FUSED_MAX_N = 4
# Elements per dequantized tile (float32: 1 MiB), small enough to stay in L2 while BLAS reads it.
TILE_ELEMENTS = 1 << 18

_Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
_KERNELS: dict[GGMLQuantizationType, tuple[_Kernel, _Kernel]] = {}
if HAVE_NUMBA:
    for _qtype, _mod in [
        (Q.Q4_0, legacy_quants),
        (Q.Q4_1, legacy_quants),
        (Q.Q5_0, legacy_quants),
        (Q.Q5_1, legacy_quants),
        (Q.Q8_0, legacy_quants),
        (Q.Q2_K, k_quants),
        (Q.Q3_K, k_quants),
        (Q.Q4_K, k_quants),
        (Q.Q5_K, k_quants),
        (Q.Q6_K, k_quants),
    ]:
        _suffix = _qtype.name.lower()
        _KERNELS[_qtype] = (getattr(_mod, f"dot_{_suffix}"), getattr(_mod, f"rows_{_suffix}"))


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """x (n, cols) -> float32 (n, rows) = x @ dequantize(W).T."""
    x = _activations(w, x)
    if w.qtype == Q.F32:
        return x @ w.raw.view(np.float32).T
    if not HAVE_NUMBA:
        return matmul_fallback(w, x)
    if w.qtype in _KERNELS and x.shape[0] <= FUSED_MAX_N:
        dot, _ = _KERNELS[w.qtype]
        out = np.empty((x.shape[0], w.rows), dtype=np.float32)
        dot(w.raw, x, F16_TABLE, out)
        return out
    return _tiled_matmul(w, x, _dequantize_rows)


def get_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W dequantized to float32 (len(ids), cols): the embedding lookup."""
    ids = _row_ids(w, ids)
    return _dequantize_rows(w, ids) if HAVE_NUMBA else get_rows_fallback(w, ids)


def matmul_fallback(w: QTensor, x: np.ndarray) -> np.ndarray:
    """matmul without numba: gguf-py dequantizes tiles, BLAS multiplies them."""
    return _tiled_matmul(w, _activations(w, x), _reference_rows)


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
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        bad = int(ids[(ids < 0) | (ids >= w.rows)][0])
        raise InputError(
            f"{w.name}: row id {bad} is outside [0, {w.rows}); is the token id from another vocabulary?"
        )
    return ids


def _tiled_matmul(
    w: QTensor, x: np.ndarray, dequantize: Callable[[QTensor, np.ndarray], np.ndarray]
) -> np.ndarray:
    out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    tile_rows = max(1, TILE_ELEMENTS // w.cols)
    for start in range(0, w.rows, tile_rows):
        stop = min(start + tile_rows, w.rows)
        tile = dequantize(w, np.arange(start, stop, dtype=np.int64))
        np.matmul(x, tile.T, out=out[:, start:stop])
    return out


def _dequantize_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W as float32, by numba kernel (quantized) or numpy (float formats)."""
    if w.qtype in FLOAT_QTYPES:
        return _float_rows(w, ids)
    _, rows = _KERNELS[w.qtype]
    out = np.empty((ids.shape[0], w.cols), dtype=np.float32)
    rows(w.raw, ids, F16_TABLE, out)
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
    rows = gguf_quants.dequantize(w.raw[ids], w.qtype)
    return np.asarray(rows, dtype=np.float32).reshape(ids.shape[0], w.cols)
