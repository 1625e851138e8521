"""The layer windows one node owns, as byte spans of the GGUF mmap: prefetch, release, residency.

Weights stay in the OS page cache (the file mapping), never in anonymous memory. Under a memory
budget smaller than the node's layers, windows are evicted when room is needed for the next one,
furthest-next-use first: windows are used cyclically (round 0, 1, ..., k-1, 0, ...), so the
window just computed is the one needed last. Eviction is madvise(MADV_DONTNEED) to drop our page
table entries, then posix_fadvise(POSIX_FADV_DONTNEED) to drop the clean pages from the cache.
Prefetch is madvise(MADV_WILLNEED), which starts the reads in the kernel and returns at once, so
window r+1 streams in from disk while window r computes. Residency is measured with mincore(2)
over the windows' pages, so what the node reports is what is really in memory (page cache:
pages another process maps cannot be dropped and do count).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prima.errors import PlanError
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from prima.scheduler.plan import Window

log = logging.getLogger("prima.weights")

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


@dataclass(frozen=True)
class Span:
    """Page-aligned bytes `[start, end)` of the file holding one window's tensors."""

    start: int
    end: int

    @property
    def n_bytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Residency:
    owned_bytes: int
    resident_bytes: int
    peak_resident_bytes: int
    budget_bytes: int
    prefetches: int
    releases: int


def window_spans(gguf: GGUFFile, weights: ModelWeights, window: Window) -> tuple[Span, ...]:
    """The page-aligned spans of a window's layers, merged where they touch. GGUF writers often
    order layers by name (blk.1, blk.10, blk.11, ...), so a window is not one span."""
    spans = []
    for i in range(window.start, window.end):
        start, end = gguf.byte_range(weights.layer_tensor_names(i))
        spans.append((start // PAGE * PAGE, -(-end // PAGE) * PAGE))
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1].end:
            merged[-1] = Span(merged[-1].start, max(end, merged[-1].end))
        else:
            merged.append(Span(start, end))
    return tuple(merged)


def resident_bytes(gguf: GGUFFile, span: Span) -> int:
    """Bytes of `span` in memory now, by mincore(2)."""
    if span.n_bytes <= 0:
        return 0
    n_pages = span.n_bytes // PAGE
    vec = (ctypes.c_ubyte * n_pages)()
    if _libc.mincore(gguf.data.ctypes.data + span.start, span.n_bytes, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * PAGE


class LayerWindows:
    """One node's windows (one per round) over the model mmap, kept within `budget_bytes`
    (0 = no budget: everything stays resident once read)."""

    def __init__(
        self, gguf: GGUFFile, weights: ModelWeights, windows: Sequence[Window], budget_bytes: int = 0
    ) -> None:
        self.gguf = gguf
        self.windows = tuple(windows)
        self.spans = tuple(window_spans(gguf, weights, w) for w in self.windows)
        self.sizes = tuple(sum(s.n_bytes for s in spans) for spans in self.spans)
        self.owned_bytes = sum(self.sizes)
        self.budget_bytes = budget_bytes
        self.limited = 0 < budget_bytes < self.owned_bytes
        biggest = max(self.sizes, default=0)
        if self.limited and biggest > budget_bytes:
            raise PlanError(
                f"--mem-budget {budget_bytes} bytes is below one window of {biggest} bytes; "
                "use more rounds (smaller windows) or raise the budget"
            )
        self._fd = os.open(gguf.path, os.O_RDONLY)
        if self.limited:
            # Fault-time read-around would pull neighbouring layers (another window) in behind
            # our back; WILLNEED still reads each window's spans exactly.
            for spans in self.spans:
                for span in spans:
                    self._madvise(span, mmap.MADV_RANDOM)
        self._lock = threading.Lock()
        self._loaded: set[int] = set()  # windows we have prefetched or computed and not released
        self._peak = 0
        self._prefetches = 0
        self._releases = 0

    # -- policy --------------------------------------------------------------------------------
    def begin(self, r: int) -> None:
        """Called before computing window `r`: make room for it, then prefetch the next one if
        the budget holds both, so its disk reads overlap this window's compute."""
        with self._lock:
            self._make_room(r, keep={r})
            self._prefetch(r)
            nxt = (r + 1) % len(self.windows)
            if nxt != r and nxt not in self._loaded and self._make_room(nxt, keep={r, nxt}):
                self._prefetch(nxt)

    def end(self, r: int) -> None:
        """Called after computing window `r`: sample residency (the peak is reached here)."""
        del r
        if self.limited:
            self._peak = max(self._peak, self.resident_bytes())

    def prefetch_all(self) -> None:
        """Without a binding budget, start reading every window at once (plan load)."""
        with self._lock:
            for r in range(len(self.windows)) if not self.limited else (0,):
                if self.windows:
                    self._make_room(r, keep={r})
                    self._prefetch(r)

    def release_all(self) -> None:
        """Drop every window from memory (a new plan, a shutdown, or a cold start in tests)."""
        with self._lock:
            for r in range(len(self.windows)):
                self._release(r)

    def _make_room(self, r: int, keep: set[int]) -> bool:
        """Evict loaded windows (furthest next use first) until window `r` fits; False if it
        cannot fit without evicting a window in `keep`."""
        if not self.limited or r in self._loaded:
            return True
        k = len(self.windows)
        need = self.sizes[r]
        # Next use of window j seen from r: j comes (j - r) mod k windows later.
        victims = sorted(self._loaded - keep, key=lambda j: (j - r) % k, reverse=True)
        used = sum(self.sizes[j] for j in self._loaded)
        while used + need > self.budget_bytes and victims:
            j = victims.pop(0)
            self._release(j)
            used -= self.sizes[j]
        return used + need <= self.budget_bytes

    # -- system calls --------------------------------------------------------------------------
    def _prefetch(self, r: int) -> None:
        if r in self._loaded:
            return
        for span in self.spans[r]:
            self._madvise(span, mmap.MADV_WILLNEED)
        self._loaded.add(r)
        self._prefetches += 1

    def _release(self, r: int) -> None:
        for span in self.spans[r]:
            self._madvise(span, mmap.MADV_DONTNEED)
            os.posix_fadvise(self._fd, span.start, span.n_bytes, os.POSIX_FADV_DONTNEED)
        self._loaded.discard(r)
        self._releases += 1
        log.debug("released window %s (%d bytes)", self.windows[r], self.sizes[r])

    def _madvise(self, span: Span, advice: int) -> None:
        if _libc.madvise(self.gguf.data.ctypes.data + span.start, span.n_bytes, advice) != 0:
            err = ctypes.get_errno()
            log.warning("madvise(%d) on %d bytes failed: %s", advice, span.n_bytes, os.strerror(err))

    # -- reporting -----------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(resident_bytes(self.gguf, s) for spans in self.spans for s in spans)

    def residency(self) -> Residency:
        return Residency(
            owned_bytes=self.owned_bytes,
            resident_bytes=self.resident_bytes(),
            peak_resident_bytes=self._peak,
            budget_bytes=self.budget_bytes,
            prefetches=self._prefetches,
            releases=self._releases,
        )

    def close(self) -> None:
        os.close(self._fd)
