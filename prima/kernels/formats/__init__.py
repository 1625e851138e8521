"""The table of quantized weight formats: one module per format, named as ggml names the type
(q4_k.py is Q4_K), each describing one block and the three steps prima computes with it:

  LAYOUT                                 the block's fields; elements and bytes from gguf-py
  dot(row, x, lut, out, r)               out[:, r] = x @ w_r from row r's raw bytes, float32
  deq(row, lut, y)                       y (cols,) = w_r dequantized
  qdot(w, r0, r1, xq, xd, xs, out, c0)   out[:, c0 + i] = x @ w[r0 + i] with x as int8 blocks
                                         (prima.kernels.int8_dots), or None: q8 mode runs dot
  unpack(row, u, sc, mn)                 row as bytes u (cols,) and an affine map per 16
                                         elements, w[j] = sc[j // 16] * u[j] + mn[j // 16]
                                         (prima.kernels.int8_gemm, q8 prefill), or None
  FORMAT = QuantFormat(LAYOUT, dot, deq, qdot, unpack, unpack_max=15)
                                         unpack_max: the largest u unpack writes (the int8
                                         GEMM's AVX2 step adds products in int16 while they fit);
                                         unpack_piece: 16 where a block's halves have maps of
                                         their own (Q6_K), else 32

`lut` is quants.F16_TABLE; `row` is one row of raw blocks (uint8), `w` the whole (rows, bytes)
array. Adding a format is a module here plus its type in QTYPES: the dispatch in
prima.kernels.dispatch, the supported-type checks and the tests all follow this table.

This package itself imports no numba, so a device without it can still list the formats
(prima.kernels.quants); `load()` imports the modules, and with them numba.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from prima.ggml_constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# The formats prima has kernels for, in the order the dispatch tests them.
QTYPES: tuple[GGMLQuantizationType, ...] = (
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
)

# A field holding one IEEE half: a block's scale or min.
F16 = "f16"


@dataclass(frozen=True)
class Layout:
    """The fields of one block in order, as (name, size in bytes or F16). The block's elements and
    bytes come from gguf-py (GGML_QUANT_SIZES, matched against ggml.h); the fields must fill the
    block exactly, so a layout that disagrees with ggml fails at import, not in a kernel."""

    qtype: GGMLQuantizationType
    fields: tuple[tuple[str, int | str], ...]

    @staticmethod
    def of(qtype: GGMLQuantizationType, **fields: int | str) -> Layout:
        """Layout.of(Q.Q4_0, d=F16, qs=16): fields in declaration order."""
        return Layout(qtype, tuple(fields.items()))

    def __post_init__(self) -> None:
        total = sum(_size(size) for _, size in self.fields)
        if total != self.nbytes:
            raise ValueError(
                f"{self.qtype.name} fields fill {total} bytes; gguf-py's block has {self.nbytes}"
            )

    @property
    def elements(self) -> int:
        """Weights per block."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes per block."""
        return GGML_QUANT_SIZES[self.qtype][1]

    def offset(self, name: str) -> int:
        """Byte offset of field `name` inside the block."""
        start = 0
        for field, size in self.fields:
            if field == name:
                return start
            start += _size(size)
        raise KeyError(f"{self.qtype.name} has no field {name!r}")

    @property
    def f16_offsets(self) -> tuple[int, ...]:
        """Byte offsets of the half-precision fields (the block's scales and mins)."""
        return tuple(self.offset(name) for name, size in self.fields if size == F16)


def _size(size: int | str) -> int:
    return 2 if size == F16 else int(size)


@dataclass(frozen=True)
class QuantFormat:
    """One entry of the table: a block layout and its numba steps (contracts above)."""

    layout: Layout
    dot: Callable[..., None]
    deq: Callable[..., None]
    qdot: Callable[..., None] | None = None
    unpack: Callable[..., None] | None = None
    unpack_max: int = 255
    unpack_piece: int = 32

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.layout.qtype


def module_name(qtype: GGMLQuantizationType) -> str:
    return f"{__name__}.{qtype.name.lower()}"


@cache
def load() -> dict[GGMLQuantizationType, QuantFormat]:
    """Every format's entry by type, in QTYPES order (imports the modules, and numba)."""
    table: dict[GGMLQuantizationType, QuantFormat] = {}
    for qtype in QTYPES:
        entry = importlib.import_module(module_name(qtype)).FORMAT
        if entry.qtype != qtype:
            raise ValueError(f"{module_name(qtype)} describes {entry.qtype.name}, not {qtype.name}")
        table[qtype] = entry
    return table
