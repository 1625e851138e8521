"""The layers one node owns, as byte spans of the GGUF mmap, and a prefetch thread that brings
them into memory ahead of compute: the streaming half of pipelined-ring parallelism.

Weights stay in the OS page cache (the file mapping), never in anonymous memory. A node computes
its layers in a fixed cyclic order (its window of round 0, of round 1, ..., then round 0 of the
next token). When they all fit its budget, the prefetch thread reads each once, in order, and
they stay. When they do not, some layers are *pinned* (read once, kept) and the rest *stream*
through a bounded buffer: the thread reads the next streamed layers in compute order while the
node (or the rest of the ring) computes, and the compute thread drops each streamed layer right
after using it. Under cyclic access an LRU page cache keeps exactly the wrong pages and rereads
everything; pinning a fixed set and streaming the rest reads only `owned - pinned` bytes per
token, the least any cache of that size can.

Reads are large and explicit: the thread queues readahead for every chunk of a layer, then
MADV_POPULATE_READ (Linux 5.14+) waits for them and maps the pages, so compute takes no faults;
elsewhere pread fills the page cache. One MADV_WILLNEED per window is not enough: the kernel caps
it at one readahead window, so most of a window would arrive by 4 KiB demand faults during
compute. Under a budget, read-around is off (MADV_RANDOM): it would pull neighbouring layers in.
The compute thread waits for a layer's read explicitly, and that wait is measured. Residency is
measured with mincore(2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prima.errors import PlanError
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from prima.plan import Window

log = logging.getLogger("prima.weights")

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22
READ_CHUNK = 8 << 20
# The kernel caps one readahead request at the device's readahead window (often 128 KiB).
READAHEAD_CHUNK = 128 << 10
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


@dataclass(frozen=True)
class Span:
    """Page-aligned bytes `[start, end)` of the file."""

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
    bytes_read: int = 0
    read_ms: float = 0.0
    wait_ms: float = 0.0
    compute_ms: float = 0.0
    pinned_layers: int = 0


@dataclass
class StreamStats:
    """Cumulative counters of the prefetch thread and of compute waiting for it."""

    bytes_read: int = 0
    read_ms: float = 0.0
    wait_ms: float = 0.0
    compute_ms: float = 0.0
    misses: int = 0  # layers compute needed that had been dropped (out-of-order visits)


def _merge(spans: list[tuple[int, int]]) -> tuple[Span, ...]:
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1].end:
            merged[-1] = Span(merged[-1].start, max(end, merged[-1].end))
        else:
            merged.append(Span(start, end))
    return tuple(merged)


def read_span(fd: int, base_address: int, span: Span, *, populate: bool = True) -> bool:
    """Read the file's bytes `span` into the page cache and map them at `base_address +
    span.start` (the file's mmap), reading exactly its pages: readahead requests of
    READAHEAD_CHUNK each (all queued at once), then MADV_POPULATE_READ waits for them and maps
    them. Without that madvise (Linux < 5.14, or `populate` false) it preads the span instead.
    Returns whether MADV_POPULATE_READ is there to use next time. The disk probe reads this way
    too, so the profile's disk speed is the prefetcher's."""
    for at in range(span.start, span.end, READAHEAD_CHUNK):
        os.posix_fadvise(fd, at, min(READAHEAD_CHUNK, span.end - at), os.POSIX_FADV_WILLNEED)
    if populate:
        if _libc.madvise(base_address + span.start, span.n_bytes, MADV_POPULATE_READ) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")
        log.info("no MADV_POPULATE_READ on this kernel; prefetching with pread")
    at = span.start
    while at < span.end:
        got = len(os.pread(fd, min(READ_CHUNK, span.end - at), at))
        if not got:
            break
        at += got
    return False


def layer_spans(gguf: GGUFFile, weights: ModelWeights, layer: int) -> tuple[Span, ...]:
    """The page-aligned span of one layer's tensors."""
    start, end = gguf.byte_range(weights.layer_tensor_names(layer))
    return (Span(start // PAGE * PAGE, -(-end // PAGE) * PAGE),)


def window_spans(gguf: GGUFFile, weights: ModelWeights, window: Window) -> tuple[Span, ...]:
    """The page-aligned spans of a window's layers, merged where they touch. GGUF writers often
    order layers by name (blk.1, blk.10, blk.11, ...), so a window is not one span."""
    return _merge(
        [(s.start, s.end) for i in range(window.start, window.end) for s in layer_spans(gguf, weights, i)]
    )


def resident_bytes(gguf: GGUFFile, span: Span) -> int:
    """Bytes of `span` in memory now, by mincore(2)."""
    return mapped_resident_bytes(gguf.data.ctypes.data, span)


def mapped_resident_bytes(base: int, span: Span) -> int:
    """Bytes of `span` (page-aligned) of the file mapped at address `base` that are in memory
    now, by mincore(2)."""
    if span.n_bytes <= 0:
        return 0
    n_pages = -(-span.n_bytes // PAGE)  # mincore reports the last, partial page too
    vec = (ctypes.c_ubyte * n_pages)()
    if _libc.mincore(base + span.start, span.n_bytes, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * PAGE


def stream_buffer_bytes(window_bytes: Sequence[int], layer_bytes: Sequence[int]) -> int:
    """Room for streamed layers: the next window read in full while the last layer of this one
    computes. The scheduler's cost model assumes the same (cost_model.stream_buffer_layers);
    when that is more than half the budget, LayerWindows keeps two layers in flight instead."""
    return max(window_bytes, default=0) + max(layer_bytes, default=0)


class LayerWindows:
    """One node's windows (one per round) over the model mmap, kept within `budget_bytes`
    (0 = no budget: every layer is read once and stays).

    The compute thread brackets each layer with `before_layer(i)` / `after_layer(i)`; a
    background thread started by `start()` does every read."""

    def __init__(
        self, gguf: GGUFFile, weights: ModelWeights, windows: Sequence[Window], budget_bytes: int = 0
    ) -> None:
        self.gguf = gguf
        self.windows = tuple(windows)
        self.spans = tuple(window_spans(gguf, weights, w) for w in self.windows)
        self.sizes = tuple(sum(s.n_bytes for s in spans) for spans in self.spans)
        # Compute order: the layers of round 0's window, round 1's, ..., then round 0 again.
        self.order = tuple(i for w in self.windows for i in range(w.start, w.end))
        self._index = {layer: j for j, layer in enumerate(self.order)}
        self._spans = {i: layer_spans(gguf, weights, i) for i in self.order}
        self._bytes = {i: sum(s.n_bytes for s in self._spans[i]) for i in self.order}
        self._window_end = {w.end - 1 for w in self.windows if w.n_layers}
        self.owned_bytes = sum(self.sizes)
        self.budget_bytes = budget_bytes
        self.limited = self._short_of(budget_bytes)
        self.pinned, self.stream_room = self._choose_pinned()
        self._fd = os.open(gguf.path, os.O_RDONLY)
        self._read_exactly = False
        if self.limited:
            self._no_read_around()
        self._cv = threading.Condition()
        self._loaded: set[int] = set()
        self._loading: int | None = None
        self._stream_used = 0
        self._pos = 0  # index in `order` of the layer computing now, or next
        self._closed = False
        self._thread: threading.Thread | None = None
        self._populate = True  # MADV_POPULATE_READ until the kernel says it has none
        self._peak = 0
        self._prefetches = 0
        self._releases = 0
        self._layer_t0 = 0.0
        self.stats = StreamStats()

    def _choose_pinned(self) -> tuple[frozenset[int], int]:
        """(pinned layers, bytes of room for streamed layers) under the budget."""
        if not self.limited:
            return frozenset(self.order), 0
        biggest = max(self._bytes.values())
        if biggest > self.budget_bytes:
            raise PlanError(
                f"this node may keep {self.budget_bytes >> 20} MiB of layers resident (--mem-budget, or what "
                f"its memory leaves), below one layer of {biggest >> 20} MiB: free memory, raise the "
                "budget, or give this node fewer layers"
            )
        room = stream_buffer_bytes(self.sizes, list(self._bytes.values()))
        if room > self.budget_bytes // 2:
            # A window ahead would crowd out the pinned layers (one round, or a budget just short
            # of the layers): keep two layers in flight instead and pin the rest.
            room = min(2 * biggest, self.budget_bytes)
        pinned: list[int] = []
        used = 0
        for layer in self.order:
            if used + self._bytes[layer] + room > self.budget_bytes:
                break
            pinned.append(layer)
            used += self._bytes[layer]
        log.info(
            "budget %d MiB below the %d MiB owned: %d layers pinned, the rest stream through %d MiB",
            self.budget_bytes >> 20,
            self.owned_bytes >> 20,
            len(pinned),
            room >> 20,
        )
        return frozenset(pinned), self.budget_bytes - used

    def _short_of(self, budget_bytes: int) -> bool:
        """Whether the layers must stream under `budget_bytes`. A shortfall under half a layer is
        left to the budget's reserve: streaming a layer every token for the sake of a megabyte
        (a session's KV cache, say) would cost far more than it saves."""
        slack = max(self._bytes.values(), default=0) // 2
        return 0 < budget_bytes and self.owned_bytes > budget_bytes + slack

    def _no_read_around(self) -> None:
        """Read exactly what is asked for: the kernel's read-around (on a fault or a read) would
        pull in neighbouring layers the budget has no room for."""
        if self._read_exactly:
            return
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        for spans in self.spans:
            for span in spans:
                self._madvise(span, mmap.MADV_RANDOM)
        self._read_exactly = True

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget while running (a session's KV cache took some of the memory, or gave
        it back): the pinned set is chosen again; layers that stop being pinned stream from now."""
        with self._cv:
            self.budget_bytes = budget_bytes
            self.limited = self._short_of(budget_bytes)
            pinned, room = self._choose_pinned()
            for layer in self._loaded:
                if layer in self.pinned and layer not in pinned:
                    self._stream_used += self._bytes[layer]
                elif layer not in self.pinned and layer in pinned:
                    self._stream_used -= self._bytes[layer]
            self.pinned, self.stream_room = pinned, room
            if self.limited:
                self._no_read_around()
            # Make room at once if the buffer now holds more than it may.
            while self._stream_used > self.stream_room:
                victim = self._furthest_streamed()
                if victim is None:
                    break
                self._release(victim)
            self._cv.notify_all()

    @property
    def largest_layer_bytes(self) -> int:
        return max(self._bytes.values(), default=0)

    @property
    def streamed_bytes_per_pass(self) -> int:
        """Bytes read from disk per forward pass once warm (0 when everything fits)."""
        return sum(self._bytes[i] for i in self.order if i not in self.pinned)

    # -- the compute side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the prefetch thread: it reads the pinned layers, then streams ahead of compute."""
        if self._thread is None and self.order:
            self._thread = threading.Thread(target=self._prefetch_loop, name="primad-prefetch", daemon=True)
            self._thread.start()

    def before_layer(self, layer: int) -> float:
        """Block until `layer` is in memory; returns the seconds waited."""
        if not self.limited and layer in self._loaded:
            # Nothing streams and the layer is in: no news for the prefetch thread, which would
            # otherwise wake, twice a layer, onto a core the compute threads are using.
            self._pos = self._index[layer]  # kept, should a smaller budget make layers stream
            self._layer_t0 = time.perf_counter()
            return 0.0
        t0 = time.perf_counter()
        with self._cv:
            self._pos = self._index[layer]
            self._cv.notify_all()
            while layer not in self._loaded:
                if self._thread is None or not self._thread.is_alive():
                    self._load_here(layer)
                    break
                self._cv.wait(timeout=1.0)
        waited = time.perf_counter() - t0
        self.stats.wait_ms += waited * 1e3
        self._layer_t0 = time.perf_counter()
        return waited

    def before_layers(self, layers: range) -> None:
        """`before_layer` for each of `layers`, computed together as one call: when every one is
        in memory and nothing streams, a check and a timestamp, not one call per layer (each
        call costs a decode step microseconds on a core just woken)."""
        if not self.limited and self._loaded.issuperset(layers):
            self._pos = self._index[layers[-1]]
            self._layer_t0 = time.perf_counter()
            return
        for layer in layers:
            self.before_layer(layer)

    def after_layers(self, layers: range) -> None:
        """`after_layer` for each of `layers`, computed together since `before_layers`."""
        if not self.limited:
            self.after_layer(layers[-1])
            return
        for layer in layers:
            self.after_layer(layer)

    def after_layer(self, layer: int) -> None:
        """`layer` is computed: drop it if it streams, and let the prefetch thread move on."""
        self.stats.compute_ms += (time.perf_counter() - self._layer_t0) * 1e3
        if not self.limited:  # every layer stays: nothing to drop, nothing to read ahead
            self._pos = (self._index[layer] + 1) % len(self.order)
            return
        if layer in self._window_end:
            self._peak = max(self._peak, self.resident_bytes())
        with self._cv:
            if layer not in self.pinned and layer in self._loaded:
                self._release(layer)
            self._pos = (self._index[layer] + 1) % len(self.order)
            self._cv.notify_all()

    def _load_here(self, layer: int) -> None:
        """Read `layer` on the compute thread (no prefetch thread): a counted miss."""
        self.stats.misses += 1
        try:
            self._read(layer)
        except OSError as exc:  # compute then faults the pages in itself
            log.warning("reading layer %d failed: %s; computing from demand faults", layer, exc)
        self._mark_loaded(layer)

    # -- the prefetch thread -------------------------------------------------------------------
    def _prefetch_loop(self) -> None:
        while True:
            with self._cv:
                target = self._next_target()
                while target is None and not self._closed:
                    self._cv.wait(timeout=1.0)
                    target = self._next_target()
                if self._closed:
                    return
                self._loading = target
            try:
                self._read(target)
            except OSError as exc:
                log.warning("reading layer %d failed: %s; compute will fault it in", target, exc)
            with self._cv:
                self._loading = None
                self._mark_loaded(target)
                self._cv.notify_all()

    def _next_target(self) -> int | None:
        """The next layer to read (pinned first, then streamed in compute order from the current
        position), making room by dropping the streamed layer needed furthest ahead; None when
        nothing should be read now."""
        for layer in self.order:
            if layer in self.pinned and layer not in self._loaded:
                return layer
        n = len(self.order)
        for d in range(n):
            layer = self.order[(self._pos + d) % n]
            if layer in self.pinned or layer in self._loaded:
                continue
            need = self._bytes[layer]
            while self._stream_used + need > self.stream_room:
                victim = self._furthest_streamed()
                if victim is None or self._distance(victim) <= d:
                    return None  # the buffer holds only layers needed sooner
                self._release(victim)
            return layer
        return None

    def _distance(self, layer: int) -> int:
        return (self._index[layer] - self._pos) % len(self.order)

    def _furthest_streamed(self) -> int | None:
        streamed = [i for i in self._loaded if i not in self.pinned]
        return max(streamed, key=self._distance, default=None)

    def _mark_loaded(self, layer: int) -> None:
        if layer not in self._loaded:
            self._loaded.add(layer)
            self._prefetches += 1
            if layer not in self.pinned:
                self._stream_used += self._bytes[layer]

    # -- system calls --------------------------------------------------------------------------
    def _read(self, layer: int) -> None:
        """Bring `layer` into memory and map it (`read_span`), timing the read."""
        t0 = time.perf_counter()
        for span in self._spans[layer]:
            self._populate = read_span(self._fd, self.gguf.data.ctypes.data, span, populate=self._populate)
        self.stats.read_ms += (time.perf_counter() - t0) * 1e3
        self.stats.bytes_read += self._bytes[layer]

    def _release(self, layer: int) -> None:
        for span in self._spans[layer]:
            self._madvise(span, mmap.MADV_DONTNEED)
            os.posix_fadvise(self._fd, span.start, span.n_bytes, os.POSIX_FADV_DONTNEED)
        if layer in self._loaded:
            self._loaded.discard(layer)
            if layer not in self.pinned:
                self._stream_used -= self._bytes[layer]
        self._releases += 1

    def _madvise(self, span: Span, advice: int) -> None:
        if _libc.madvise(self.gguf.data.ctypes.data + span.start, span.n_bytes, advice) != 0:
            err = ctypes.get_errno()
            log.warning("madvise(%d) on %d bytes failed: %s", advice, span.n_bytes, os.strerror(err))

    def release_all(self) -> None:
        """Drop every layer from memory (a new plan, a shutdown, or a cold start in tests)."""
        with self._cv:
            for layer in self.order:
                self._release(layer)
            self._cv.notify_all()

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
            bytes_read=self.stats.bytes_read,
            read_ms=self.stats.read_ms,
            wait_ms=self.stats.wait_ms,
            compute_ms=self.stats.compute_ms,
            pinned_layers=len(self.pinned),
        )

    def close(self) -> None:
        """Stop the prefetch thread (bounded wait) and close the file."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        os.close(self._fd)
