"""The CPU backend: fused numba kernels over the raw GGUF blocks (prima.kernels.matmul)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from prima.errors import InputError
from prima.kernels import matmul as kernels
from prima.kernels.tensor import QTensor

if TYPE_CHECKING:
    from prima.kernels.decode_layer import FusedBlock
    from prima.model.config import ModelConfig
    from prima.model.weights import LayerWeights

log = logging.getLogger("prima.backends")


MODES: tuple[str, ...] = ("q8", "exact")


class CpuBackend:
    """Runs every supported weight format on the host CPU with at most `threads` workers (None:
    one per core): numba's pool for decode kernels, as many Python threads for prefill tiles.
    `mode` "q8" quantizes decode activations to int8 blocks for the integer kernels (llama.cpp's
    arithmetic, logits within ~1e-3 of exact); "exact" keeps float32 activations throughout."""

    name = "cpu"

    def __init__(self, threads: int | None = None, mode: str = "q8") -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if mode not in MODES:
            raise InputError(f"unknown cpu mode {mode!r}; available: {', '.join(MODES)}")
        self.mode = mode
        self._int8 = mode == "q8"
        self.threads = threads if threads is not None else (os.cpu_count() or 1)
        if kernels.HAVE_NUMBA:
            import numba

            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        else:
            log.warning("numba is not installed: the cpu backend falls back to slow numpy kernels")
        kernels.set_threads(self.threads)

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n, cols); returns float32 (n, rows)."""
        return kernels.matmul(w, x, self._int8)

    def matmul_many(self, ws: Sequence[QTensor], x: np.ndarray) -> np.ndarray:
        """y = x @ [W0; W1; ...].T (n, sum of rows): one launch for weights of one format."""
        return kernels.matmul_many(ws, x, self._int8)

    # Blocks of up to this many tokens run as one compiled call (prima.kernels.decode_layer).
    fused_max_tokens = kernels.FUSED_MAX_N

    def fused_block(
        self, layer: LayerWeights, config: ModelConfig, inv_freq: np.ndarray, window: int
    ) -> FusedBlock | None:
        """The one-call form of block `layer` for decode, or None (no numba, or a projection in
        a float format): the model then runs the block step by step through matmul_many."""
        if not kernels.HAVE_NUMBA:
            return None
        from prima.kernels.decode_layer import FusedBlock

        return FusedBlock.build(layer, config, inv_freq, window)

    def run_block(
        self,
        block: FusedBlock,
        x: np.ndarray,
        positions: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        t: int,
    ) -> np.ndarray:
        """Hidden states x (n <= fused_max_tokens, d) through `block`, writing its keys and values
        into the cache rows at `positions` (already reserved); t valid rows afterwards."""
        return block.run(x, positions, k_cache, v_cache, t, self._int8)

    def get_rows(self, w: QTensor, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` of W as float32 (len(ids), cols): the embedding lookup."""
        return kernels.get_rows(w, ids)
