"""A weight tensor as the kernels see it: raw GGUF blocks, viewed (never copied) from the mmap."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prima.ggml_constants import GGMLQuantizationType


@dataclass(frozen=True, eq=False)
class QTensor:
    """`raw` is uint8 of shape (rows, row_bytes): row r holds the blocks of output feature r.
    `shape` is the logical numpy shape (rows, cols); cols is the input dimension."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    raw: np.ndarray

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def n_bytes(self) -> int:
        return int(self.raw.nbytes)
