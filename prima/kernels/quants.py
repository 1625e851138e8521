"""The weight formats prima runs, their block geometry, and a clear error for the rest.

The quantized formats are the table in prima.kernels.formats; block sizes come from gguf-py
(`GGML_QUANT_SIZES`, matched against ggml.h), so a format is described once. Nothing here needs
numba: a device without it checks the same types and runs them on gguf-py's dequantizer."""

from __future__ import annotations

import numpy as np

from prima.errors import UnsupportedModelError
from prima.ggml_constants import GGML_QUANT_SIZES, GGMLQuantizationType
from prima.kernels import formats

Q = GGMLQuantizationType

FLOAT_QTYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F32, Q.F16, Q.BF16})
QUANT_QTYPES: frozenset[GGMLQuantizationType] = frozenset(formats.QTYPES)
SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = FLOAT_QTYPES | QUANT_QTYPES

# f16 bit pattern -> float32, indexed by the 16-bit word. numba has no float16 type, and one
# 256 KiB table lookup per 32-element block costs far less than bit-twiddling the conversion.
# The table holds every NaN pattern on purpose: ARM's hardware conversion flags the signalling
# ones as invalid, which numpy would print as a RuntimeWarning at import.
with np.errstate(invalid="ignore"):
    F16_TABLE: np.ndarray = (
        np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    )


def _names(qtypes: frozenset[GGMLQuantizationType]) -> str:
    return ", ".join(sorted(q.name for q in qtypes))


def check_supported(qtype: GGMLQuantizationType | int, tensor_name: str) -> None:
    """Raise UnsupportedModelError unless prima has kernels for `qtype` (checked at model load,
    so the user learns about an exotic quantization before any compute starts)."""
    if qtype not in SUPPORTED_QTYPES:
        type_name = qtype.name if isinstance(qtype, GGMLQuantizationType) else f"type id {qtype}"
        raise UnsupportedModelError(
            f"tensor {tensor_name!r} is stored as {type_name}, which prima cannot run; supported "
            f"types: {_names(SUPPORTED_QTYPES)}. Use a GGUF quantized to one of these (e.g. Q4_K_M)"
        )


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Bytes one row of `cols` elements occupies; `cols` must fill whole blocks."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if cols % elems:
        raise ValueError(f"{qtype.name} rows hold multiples of {elems} elements, not {cols}")
    return cols // elems * nbytes
