"""The KV cache of one session, for the layers one node owns (never the whole model's)."""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np

from prima.errors import ContextFullError
from prima.kernels.ops_reference import cache_forms
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


# Keys and values are stored as IEEE halves by default, as llama.cpp stores them: half the
# memory of float32 (SmolLM2 at 4096 tokens: 46 instead of 92 MiB), and the values llama.cpp's
# attention reads. The CPU backend's exact mode keeps float32 (llama.cpp's F32 KV run).
KV_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float16), np.dtype(np.float32))


def kv_bytes(
    config: ModelConfig, n_ctx: int, n_layers: int, dtype: np.dtype | type | str = np.float16
) -> int:
    """The bytes a KVCache of `n_layers` layers and `n_ctx` positions takes, known before it is
    allocated (so a request too large is refused without touching memory)."""
    return 2 * n_layers * n_ctx * config.n_kv_heads * config.head_dim * np.dtype(dtype).itemsize


class KVCache:
    """Keys and values per owned layer, each (n_ctx, n_kv_heads, head_dim), float16 or float32.

    All layers share one anonymous mapping whose pages the OS fills with zeros when first
    written: a session holds memory for the positions it has used, not for its whole context.

    `length` counts the positions written so far; writes must be contiguous from there (a
    rollback to an earlier length is allowed, e.g. to replay after a failure)."""

    def __init__(
        self, config: ModelConfig, n_ctx: int, layers: Iterable[int], dtype: np.dtype | type = np.float16
    ) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"a KV cache holds float16 or float32, not {self.dtype}")
        self.n_ctx = n_ctx
        self.layers = tuple(sorted(set(layers)))
        shape = (n_ctx, config.n_kv_heads, config.head_dim)
        block = _zero_pages(2 * len(self.layers) * int(np.prod(shape)) * self.dtype.itemsize)
        arrays = np.frombuffer(block, dtype=self.dtype).reshape((2, len(self.layers), *shape))
        self.k = {layer: arrays[0, j] for j, layer in enumerate(self.layers)}
        self.v = {layer: arrays[1, j] for j, layer in enumerate(self.layers)}
        self._written = WrittenPositions(n_ctx, self.layers)
        self._kernel_arrays = {layer: cache_forms(self.k[layer], self.v[layer]) for layer in self.layers}

    def kernel_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(k, v as float32, k, v as uint16 halves) of `layer`, the pair this cache does not hold
        empty: compiled kernels take both forms, so that one compiled variant serves both."""
        return self._kernel_arrays[layer]

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


def _zero_pages(n_bytes: int) -> mmap.mmap | bytearray:
    """n_bytes of zeros, writable, that take no memory until written: a private anonymous
    mapping (np.zeros may reuse freed heap memory that it must clear, touching every page)."""
    if n_bytes == 0:
        return bytearray()
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, n_bytes, flags=flags) if flags else mmap.mmap(-1, n_bytes)
