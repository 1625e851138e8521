"""Random weights in every supported format and the float64 reference to compare kernels with."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from prima.kernels.tensor import QTensor

Q = GGMLQuantizationType

# Byte offsets of the f16 scale fields inside one block (ggml's block_* structs).
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
ALL_QTYPES = [Q.F32, Q.F16, Q.BF16, *F16_FIELDS]


def random_qtensor(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> QTensor:
    """Float formats are quantized from random data; block formats are random bytes with sane
    f16 scales, so every bit pattern of the packed fields is exercised."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        data = gguf_quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        return QTensor("w", qtype, (rows, cols), data.view(np.uint8).reshape(rows, -1))
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.uniform(-1.0, 1.0, n_blocks) * 0.05).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return QTensor("w", qtype, (rows, cols), blocks.reshape(rows, -1))


def reference(w: QTensor) -> np.ndarray:
    """The whole weight, dequantized by gguf-py, as float64 (rows, cols)."""
    return np.asarray(gguf_quants.dequantize(w.raw, w.qtype), dtype=np.float64).reshape(w.shape)


def relative_error(y: np.ndarray, x: np.ndarray, w_ref: np.ndarray) -> float:
    """Error against the float64 product, relative to sum |x||w| so cancellation cannot hide it."""
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(w_ref).T + 1e-30
    return float((np.abs(y - x64 @ w_ref.T) / scale).max())
