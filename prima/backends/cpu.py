"""The CPU backend: fused numba kernels over the raw GGUF blocks (prima.kernels.matmul)."""

from __future__ import annotations

import logging

import numpy as np

from prima.kernels import matmul as kernels
from prima.kernels.tensor import QTensor

log = logging.getLogger("prima.backends")


class CpuBackend:
    """Runs every supported weight format on the host CPU. `threads` caps numba's worker pool
    (None keeps numba's default, one per core); BLAS keeps its own setting."""

    name = "cpu"

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        if threads is not None and kernels.HAVE_NUMBA:
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        if not kernels.HAVE_NUMBA:
            log.warning("numba is not installed: the cpu backend falls back to slow numpy kernels")

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n, cols); returns float32 (n, rows)."""
        return kernels.matmul(w, x)

    def get_rows(self, w: QTensor, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` of W as float32 (len(ids), cols): the embedding lookup."""
        return kernels.get_rows(w, ids)
