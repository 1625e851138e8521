"""A model as the engines drive it, split where the ring splits it: `embed` (head node), windows
of layers (every node), `output_logits` (head node), each computed by a backend.

The arithmetic lives in the backend (prima.backends.reference is the readable forward pass the
CPU runs); this class only keeps the windows an engine asked for ready, so the single-device
engine, the daemon's worker and the tests all drive any backend the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prima.backends.base import Backend, KVState, SessionBatching, WindowHandle, host_backend
from prima.forward.placement import Piece, SplitKV
from prima.model.config import ModelConfig
from prima.model.weights import ModelWeights


class WindowedModel:
    """A decoder-only transformer over mmap'd GGUF weights, computed by `backend`."""

    def __init__(self, weights: ModelWeights, backend: Backend) -> None:
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.backend = backend
        # Where layers that a plan leaves off the accelerator run (`backend` itself on a CPU).
        self.host = host_backend(backend)
        self._windows: dict[Piece, WindowHandle] = {}

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Token ids (n,) -> hidden states (n, d_model) float32."""
        return self.backend.embed(np.asarray(token_ids, dtype=np.int64))

    def whole(self, layers: range) -> Piece:
        """`layers` as one piece on this model's own backend (the accelerator, if it is one)."""
        return Piece(layers, self.backend.accelerator)

    def backend_of(self, piece: Piece) -> Backend:
        return self.backend if piece.on_accel else self.host

    def window(self, piece: Piece | range) -> WindowHandle:
        """A piece (or layers on this model's backend) made ready, once; kept until released."""
        key = piece if isinstance(piece, Piece) else self.whole(piece)
        handle = self._windows.get(key)
        if handle is None:
            handle = self._windows[key] = self.backend_of(key).load_window(key.layers)
        return handle

    def release_windows(self, keep: set[Piece] | None = None) -> None:
        """Release every window loaded so far, except those in `keep`."""
        for piece in list(self._windows):
            if keep is None or piece not in keep:
                self.backend_of(piece).release_window(self._windows.pop(piece))

    def release_layers(self, layers: set[int]) -> None:
        """Release the windows holding any of `layers` (their bytes changed: fetched)."""
        self.release_windows(keep={p for p in self._windows if not layers.intersection(p.layers)})

    def forward_layers(
        self, h: np.ndarray, positions: np.ndarray, start: int, end: int, cache: KVState
    ) -> np.ndarray:
        """Run layers [start, end) on hidden states h (n, d) of tokens at `positions` (n,)."""
        return self.run(self.whole(range(start, end)), h, positions, cache)

    def run(self, piece: Piece, h: np.ndarray, positions: np.ndarray, cache: KVState) -> np.ndarray:
        """Run `piece`'s layers on its backend; `cache` is a SplitKV or the backend's own state."""
        kv = cache.part(piece) if isinstance(cache, SplitKV) else cache
        return self.backend_of(piece).run_window(self.window(piece), h, positions, kv)

    @property
    def decode_batch_rows(self) -> int:
        """Sessions' decode steps one `forward_sessions` pass may carry, each computed exactly
        as it would be alone; 1 when the backend cannot batch sessions."""
        if not isinstance(self.backend, SessionBatching):
            return 1
        return max(1, self.backend.decode_batch_rows)

    def forward_sessions(
        self,
        h: np.ndarray,
        positions: np.ndarray,
        start: int,
        end: int,
        sessions: Sequence[tuple[KVState, int]],
    ) -> np.ndarray:
        """`forward_layers` over the rows of several sessions, each with its cache and row
        count, in row order: one read of the weights for all (continuous batching)."""
        if not isinstance(self.backend, SessionBatching):
            raise TypeError(f"the {self.backend.name} backend cannot batch sessions (decode_batch_rows is 1)")
        return self.backend.run_window_sessions(self.window(range(start, end)), h, positions, sessions)

    def output_logits(self, h: np.ndarray) -> np.ndarray:
        """Hidden states (n, d) -> logits (n, vocab) float32 through the final norm and head."""
        return self.backend.logits(h)

    def output_norm(self, h: np.ndarray) -> np.ndarray:
        """Hidden states (n, d) -> the final norm's output (n, d), the output head's input; on
        the host, as it is cheap and every backend's head starts with it."""
        return host_backend(self.backend).output_norm(h)

    def new_cache(self, n_ctx: int, layers: range | None = None) -> KVState:
        return self.backend.new_kv(n_ctx, layers if layers is not None else range(self.config.n_layers))

    def new_split_cache(self, n_ctx: int, accel_layers: list[int], host_layers: list[int]) -> SplitKV:
        """KV state for layers split between the accelerator and the host (a daemon's session)."""
        accel = self.backend.new_kv(n_ctx, accel_layers) if accel_layers else None
        host = self.host.new_kv(n_ctx, host_layers) if host_layers else None
        return SplitKV(n_ctx, accel, host)
