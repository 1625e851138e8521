"""The CPU backend: the reference forward pass (backends.reference) on fused numba kernels over
the raw GGUF blocks (prima.kernels.matmul), plus a one-call decode block of its own.

At decode (up to `fused_max_tokens` tokens) a whole block runs as one compiled call
(prima.kernels.decode_layer): the same kernels in the same order as the reference block, so the
same bits (tests/kernels/test_decode_layer.py), without ~20 Python-level launches per layer.
Without numba, everything runs the reference pass on numpy glue (slow, but it runs).

Decode steps re-choose their thread count as they run (prima.backends.decode_threads): `threads`
is the most a step uses, and a machine whose other processes keep a core busy gets fewer.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prima.backends import reference
from prima.backends.decode_threads import DecodeThreads, adaptive_by_default
from prima.backends.modes import EXACT, MODES, Q8
from prima.backends.reference import BlockParams
from prima.errors import InputError
from prima.kernels import matmul as kernels
from prima.kernels.tensor import QTensor
from prima.model.weights import ModelWeights
from prima.weights.kv_cache import KVCache

if TYPE_CHECKING:
    from prima.backends.cpu_decode import FusedBlock

log = logging.getLogger("prima.backends")

# The fewest rows a row piece may have (see CpuOps.row_piece_unit).
ROW_PIECE_MIN_ROWS = 64


class CpuOps:
    """Matmuls on the host CPU with at most `threads` workers (None: one per core): numba's pool
    for decode kernels and the int8 GEMM, as many Python threads for BLAS prefill tiles. `mode`
    "q8" quantizes activations to int8 blocks for the integer kernels, at decode and prefill
    (llama.cpp's arithmetic, logits within ~1e-3 of exact); "exact" keeps float32 activations
    throughout."""

    def __init__(self, threads: int | None = None, mode: str = Q8) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if mode not in MODES:
            raise InputError(f"unknown cpu mode {mode!r}; available: {', '.join(MODES)}")
        self.mode = mode
        self.int8 = mode == Q8
        self.threads = threads if threads is not None else (os.cpu_count() or 1)
        if kernels.HAVE_NUMBA:
            import numba

            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        else:
            log.warning("numba is not installed: the cpu backend falls back to slow numpy kernels")
        kernels.set_threads(self.threads)

    def use_threads(self, threads: int) -> None:
        """Run this OS thread's next numba launches on `threads` workers (numba's count is per
        calling thread)."""
        if kernels.HAVE_NUMBA:
            import numba

            numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n, cols); returns float32 (n, rows)."""
        return kernels.matmul(w, x, self.int8)

    def matmul_many(self, ws: Sequence[QTensor], x: np.ndarray) -> np.ndarray:
        """y = x @ [W0; W1; ...].T (n, sum of rows): one launch for weights of one format."""
        return kernels.matmul_many(ws, x, self.int8)

    def get_rows(self, w: QTensor, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` of W as float32 (len(ids), cols): the embedding lookup."""
        return kernels.get_rows(w, ids)


@dataclass(frozen=True)
class CpuWindow:
    """A window on the CPU: its blocks' parameters (views over the mmap, nothing copied) and
    their one-call decode form where every projection has a fused kernel."""

    layers: range
    blocks: tuple[BlockParams, ...]
    fused: tuple[FusedBlock | None, ...]


class CpuBackend:
    """A model's layers computed on the host CPU (see CpuOps for `threads` and `mode`)."""

    name = "cpu"
    windows_bit_identical = True
    accelerator = False

    def __init__(
        self,
        weights: ModelWeights,
        threads: int | None = None,
        mode: str = Q8,
        adapt_threads: bool | None = None,
    ) -> None:
        """`adapt_threads`: re-choose decode threads from measured steps (None: yes, unless
        PRIMA_DECODE_THREADS=fixed)."""
        self.weights = weights
        self.config = weights.config
        self.ops = CpuOps(threads, mode)
        self.mode = mode
        # Blocks of up to this many tokens run as one compiled call; 0 turns the fast path off.
        self.fused_max_tokens = kernels.FUSED_MAX_N if kernels.HAVE_NUMBA else 0
        # The decode kernels of quantized and float weights compute each row as a pass of that
        # row alone would; the int8 GEMM and BLAS tiles (longer batches) do it in another order.
        self.batch_identical_tokens = self.fused_max_tokens if self._rows_computed_alone() else 1
        # Pieces of whole attention blocks keep a batch's bits (prima.forward.row_pieces), and
        # of 64 rows or more: a product of fewer rows by a tiny model's weight (M*N*K <= 2^16
        # here) takes OpenBLAS's small-matrix kernel, which sums in another order. The numpy
        # glue without numba attends over the whole batch at once.
        self.row_piece_unit = (
            math.lcm(ROW_PIECE_MIN_ROWS, self._attention_block_rows()) if kernels.HAVE_NUMBA else 0
        )
        adapt = adaptive_by_default() if adapt_threads is None else adapt_threads
        self._adapt = adapt and kernels.HAVE_NUMBA and self.ops.threads > 1
        self._decode_threads: dict[range, DecodeThreads] = {}

    def load_window(self, layers: range) -> CpuWindow:
        self.weights.validate(layers)
        blocks = tuple(BlockParams.of(self.weights.layer(i), self.config) for i in layers)
        return CpuWindow(layers, blocks, tuple(self._fused_block(p) for p in blocks))

    def release_window(self, window: CpuWindow) -> None:
        """Nothing to free: the window is views over the mmap, whose pages the daemon's layer
        windows (prima.weights.window) keep or drop."""

    @property
    def logit_tolerance(self) -> float:
        """|logit - llama.cpp's| on the tiny F32 models (q8 computes F32 weights in float32),
        against llama.cpp's run with the same KV cache: float32 rounding, and in q8 mode a half
        flipped where float32 noise meets a boundary of the half grid (measured up to ~6e-3)."""
        return 1e-3 if self.mode == EXACT else 1e-2

    @property
    def kv_dtype(self) -> np.dtype:
        """What the KV cache holds: halves as llama.cpp keeps them, float32 in exact mode (the
        oracle's F32 run)."""
        return np.dtype(np.float32 if self.mode == EXACT else np.float16)

    def new_kv(self, n_ctx: int, layers: Iterable[int]) -> KVCache:
        return KVCache(self.config, n_ctx, layers, self.kv_dtype)

    def run_window(
        self, window: CpuWindow, hidden: np.ndarray, positions: np.ndarray, kv: KVCache
    ) -> np.ndarray:
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        fast = h.shape[0] <= self.fused_max_tokens
        chooser = self.decode_threads(window) if fast else None
        threads = chooser.next_threads() if chooser is not None else self.ops.threads
        self.ops.use_threads(threads)
        attn_parallel_min = self._attention_parallel_min(threads) if fast else 0
        start = time.perf_counter()
        for params, fused in zip(window.blocks, window.fused, strict=True):
            i = params.weights.index
            if fused is not None and fast:
                t = kv.reserve(i, positions)
                h = fused.run(h, positions, kv.kernel_arrays(i), t, self.ops.int8, attn_parallel_min)
            else:
                h = reference.block(self.config, params, self.ops, h, positions, kv)
        if chooser is not None and h.shape[0] == 1:  # a step of one token: the steps compared
            chooser.record(threads, (time.perf_counter() - start) * 1000.0)
        return h

    def decode_threads(self, window: CpuWindow) -> DecodeThreads | None:
        """The thread chooser of `window`'s decode steps (None: fixed at `threads`)."""
        if not self._adapt:
            return None
        chooser = self._decode_threads.get(window.layers)
        if chooser is None:
            chooser = self._decode_threads.setdefault(window.layers, DecodeThreads(self.ops.threads))
        return chooser

    @property
    def decode_batch_rows(self) -> int:
        """Rows a decode pass may carry with each row's arithmetic that of a pass alone: up to
        here the matmuls run the fused per-row kernels; above, the int8 GEMM or dequantized
        tiles and BLAS compute in another order."""
        return self.fused_max_tokens

    def run_window_sessions(
        self,
        window: CpuWindow,
        hidden: np.ndarray,
        positions: np.ndarray,
        sessions: Sequence[tuple[KVCache, int]],
    ) -> np.ndarray:
        """`run_window` over the rows of several sessions, each with its cache and row count
        (in row order): the weights are read once for all of them (continuous batching)."""
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        chooser = self.decode_threads(window)
        self.ops.use_threads(chooser.current if chooser is not None else self.ops.threads)
        for params in window.blocks:
            h = reference.block_sessions(self.config, params, self.ops, h, positions, sessions)
        return h

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return reference.embed(self.weights, self.ops, token_ids)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return reference.output_logits(self.weights, self.ops, hidden)

    def output_norm(self, hidden: np.ndarray) -> np.ndarray:
        return reference.final_norm(self.weights, hidden)

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        return self.ops.matmul(w, x)

    def _rows_computed_alone(self) -> bool:
        """Whether every projection of every layer and the output head has a decode kernel that
        computes each row of a few as that row alone (read from the tensor types alone: no layer
        need be loaded, or even present)."""
        if not self.fused_max_tokens:  # no numba: nothing is fused (and its modules do not load)
            return False
        from prima.backends.cpu_decode import PROJECTIONS
        from prima.kernels import drivers

        tensors = self.weights.gguf.tensors
        names = [f"blk.{i}.{p}.weight" for i in range(self.config.n_layers) for p in PROJECTIONS]
        types = [tensors[n].qtype for n in names if n in tensors] + [self.weights.output.qtype]
        return all(int(t) in drivers.QUANTIZED_IDS or t in kernels.FLOAT_ROW_QTYPES for t in types)

    def _attention_block_rows(self) -> int:
        from prima.kernels import prefill_attention

        return prefill_attention.BLOCK_ROWS

    def _attention_parallel_min(self, threads: int) -> int:
        from prima.kernels import attention_compiled

        return attention_compiled.attention_parallel_min(threads)

    def _fused_block(self, params: BlockParams) -> FusedBlock | None:
        """The one-call form of a block, or None (no numba, or a projection in a float format)."""
        if not kernels.HAVE_NUMBA:
            return None
        from prima.backends.cpu_decode import FusedBlock

        return FusedBlock.build(params, self.config)
