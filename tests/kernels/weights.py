"""Random weights in every supported format and the float64 reference to compare kernels with."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from prima.kernels import formats
from prima.kernels.tensor import QTensor

Q = GGMLQuantizationType

FORMATS = formats.load()
ALL_QTYPES = [Q.F32, Q.F16, Q.BF16, *FORMATS]


def random_qtensor(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> QTensor:
    """Float formats are quantized from random data; block formats are random bytes with sane
    f16 scales, so every bit pattern of the packed fields is exercised. Read-only, as a model's
    mapped weights are: the kernels then run the variant models run (and the shared kernel cache
    holds no writable-weight variants, which every process would preload)."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        data = gguf_quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        return QTensor("w", qtype, (rows, cols), _read_only(data.view(np.uint8).reshape(rows, -1)))
    layout = FORMATS[qtype].layout
    n_blocks = rows * cols // layout.elements
    blocks = rng.integers(0, 256, size=(n_blocks, layout.nbytes), dtype=np.uint8)
    for off in layout.f16_offsets:
        scale = (rng.uniform(-1.0, 1.0, n_blocks) * 0.05).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return QTensor("w", qtype, (rows, cols), _read_only(blocks.reshape(rows, -1)))


def _read_only(raw: np.ndarray) -> np.ndarray:
    raw.flags.writeable = False
    return raw


def reference(w: QTensor) -> np.ndarray:
    """The whole weight, dequantized by gguf-py, as float64 (rows, cols)."""
    return np.asarray(gguf_quants.dequantize(w.raw, w.qtype), dtype=np.float64).reshape(w.shape)


def relative_error(y: np.ndarray, x: np.ndarray, w_ref: np.ndarray) -> float:
    """Error against the float64 product, relative to sum |x||w| so cancellation cannot hide it."""
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(w_ref).T + 1e-30
    return float((np.abs(y - x64 @ w_ref.T) / scale).max())
