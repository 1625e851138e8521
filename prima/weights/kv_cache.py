"""The KV cache of one session, for the layers one node owns (never the whole model's)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from prima.errors import ContextFullError
from prima.model.config import ModelConfig


class WrittenPositions:
    """How many positions of each layer's KV are written: writes must continue from there (or
    restart earlier, e.g. to replay after a failure), within a context of `n_ctx`. Shared by
    every form of KV state (host arrays here, device buffers in the acl backend)."""

    def __init__(self, n_ctx: int, layers: tuple[int, ...]) -> None:
        self.n_ctx = n_ctx
        self._length = dict.fromkeys(layers, 0)

    def length(self, layer: int) -> int:
        return self._length[layer]

    def advance(self, layer: int, start: int, end: int) -> int:
        """Count [start, end) as written next and return `end`; ContextFullError past the
        context, ValueError for a write that would leave a gap."""
        if end > self.n_ctx:
            raise ContextFullError(
                f"context full: position {end - 1} does not fit a context of {self.n_ctx} tokens; "
                "start a new session or raise --ctx"
            )
        if start > self._length[layer]:
            raise ValueError(f"layer {layer}: write at {start} leaves a gap after {self._length[layer]}")
        self._length[layer] = end
        return end

    def truncate(self, length: int) -> None:
        """Forget every position >= length (the data stays but is never read)."""
        for i in self._length:
            self._length[i] = min(self._length[i], length)


def kv_bytes(config: ModelConfig, n_ctx: int, n_layers: int) -> int:
    """The bytes a KVCache of `n_layers` layers and `n_ctx` positions takes, known before it is
    allocated (so a request too large is refused without touching memory)."""
    return 2 * n_layers * n_ctx * config.n_kv_heads * config.head_dim * np.dtype(np.float32).itemsize


class KVCache:
    """float32 keys and values per owned layer, each (n_ctx, n_kv_heads, head_dim).

    `length` counts the positions written so far; writes must be contiguous from there (a
    rollback to an earlier length is allowed, e.g. to replay after a failure)."""

    def __init__(self, config: ModelConfig, n_ctx: int, layers: Iterable[int]) -> None:
        self.n_ctx = n_ctx
        self.layers = tuple(sorted(set(layers)))
        shape = (n_ctx, config.n_kv_heads, config.head_dim)
        self.k = {i: np.zeros(shape, dtype=np.float32) for i in self.layers}
        self.v = {i: np.zeros(shape, dtype=np.float32) for i in self.layers}
        self._written = WrittenPositions(n_ctx, self.layers)

    @property
    def n_bytes(self) -> int:
        return sum(a.nbytes for a in self.k.values()) * 2

    def length(self, layer: int) -> int:
        return self._written.length(layer)

    def store(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
        """Write k, v (n, KVH, hd) at `positions` and return the number of valid positions."""
        end = self.reserve(layer, positions)
        self.k[layer][int(positions[0]) : end] = k
        self.v[layer][int(positions[0]) : end] = v
        return end

    def reserve(self, layer: int, positions: np.ndarray) -> int:
        """Check that `positions` (contiguous) can be written next, count them as written, and
        return the number of valid positions: for a kernel that writes the rows itself."""
        return self._written.advance(layer, int(positions[0]), int(positions[-1]) + 1)

    def truncate(self, length: int) -> None:
        """Forget every position >= length (the data stays but is never read)."""
        self._written.truncate(length)
