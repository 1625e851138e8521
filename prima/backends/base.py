"""The compute interface the model code runs on. A backend owns the heavy linear algebra
(quantized matmul, embedding row lookup); the model code never branches on weight format or
device. Backends are chosen by name: `cpu` now, `cann` (Ascend NPU via CANN's `acl`) later."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from prima.kernels.tensor import QTensor


class Backend(Protocol):
    name: str

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n, cols); returns float32 (n, rows)."""
        ...

    def matmul_many(self, ws: Sequence[QTensor], x: np.ndarray) -> np.ndarray:
        """y = x @ [W0; W1; ...].T, float32 (n, sum of rows), for weights sharing `cols` (merged
        q/k/v and gate/up projections: one call where the backend can fuse them)."""
        ...

    def get_rows(self, w: QTensor, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` of W as float32 (len(ids), cols): the embedding lookup."""
        ...


# Optional, for a backend that can run a whole transformer block in one call at decode (the CPU
# backend does): `fused_block(layer, config, inv_freq, window)` returns an opaque block or None,
# `run_block(block, x, positions, k_cache, v_cache, t)` runs it on up to `fused_max_tokens`
# tokens. The model looks them up with getattr; a backend without them runs blocks step by step.
