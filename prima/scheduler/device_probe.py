"""Measure this machine into a DeviceProfile: memory, disk, CPU throughput per weight format.

Every probe is short (well under a second at the default sizes; the disk probe, which must see
sustained streaming, stops after two seconds) and takes its size as an argument, so tests run it
small. Network latency and bandwidth to a peer are measured by the
networking layer and passed in. Matmul throughput comes from an injected `kernel_bench(format)`
so the profile reflects the kernels prima really runs; without one, a numpy float32 GEMV stands
in for every format.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from prima import paths
from prima.model.gguf_file import GGUFFile
from prima.scheduler.memory import read_memory_limit
from prima.scheduler.profile_schema import AcceleratorProfile, DeviceProfile, ModelProfile
from prima.weights.window import PAGE, Span, mapped_resident_bytes, read_span

log = logging.getLogger("prima.scheduler")

KernelBench = Callable[[str], float]
MiB = 1 << 20
DEFAULT_PROBE_DIR = paths.cache_root()
SCRATCH_BYTES = 64 * MiB  # at most this much is written for the disk probe
COLD_FRACTION = 16  # a probe piece with more than 1/16 of its pages cached is skipped


@dataclass(frozen=True)
class ProbeSizes:
    """How much work each probe does: bigger is steadier, smaller is faster."""

    mem_bytes: int = 64 * MiB
    disk_bytes: int = 256 * MiB  # read for at most disk_seconds
    disk_seconds: float = 2.0
    gemv_rows: int = 2048
    gemv_cols: int = 2048
    repeats: int = 5


def os_class() -> str:
    """One of profile.OS_CLASSES. Android reports itself as Linux, so look for its markers."""
    if sys.platform == "android" or "ANDROID_ROOT" in os.environ or hasattr(sys, "getandroidapilevel"):
        return "android"
    return {"Linux": "linux", "Darwin": "macos", "Windows": "windows"}.get(platform.system(), "other")


def usable_ram_bytes() -> tuple[int, int]:
    """(total, usable) for this process: the host's RAM or its memory cgroup's limit, whichever
    binds (a container, a systemd MemoryMax=), and of that what page cache could still take
    (free + reclaimable, less anonymous memory), minus a reserve for the owner's apps."""
    limit = read_memory_limit()
    return limit.total, limit.weights_budget()


def measure_mem_bandwidth(n_bytes: int = 64 * MiB, repeats: int = 5) -> float:
    """Bytes/s of a large numpy copy (each byte is read once and written once), best of
    `repeats`: the rate at which a GEMV can stream weights and KV cache from RAM."""
    src = np.ones(max(n_bytes // 8, 1), dtype=np.float64)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / max(best, 1e-9)


def measure_disk_read(
    path: str | os.PathLike[str] | None = None,
    n_bytes: int = 256 * MiB,
    scratch_dir: Path = DEFAULT_PROBE_DIR,
    *,
    piece_bytes: int = 16 * MiB,
    max_seconds: float = 2.0,
    load: Callable[[], None] | None = None,
) -> float:
    """Bytes/s streaming up to `n_bytes` of `path` from disk as a short-of-memory device streams
    layers: dropped from the page cache first, then read in layer-sized pieces the way the
    prefetch thread reads (weights.window.read_span), while `load` (standing in for compute) runs
    in another thread. Stops after `max_seconds`. A short cold read alone overstated this: the
    unthrottled streaming ring of docs/performance.md ran 32% slower than planned from it.
    Without a path, or when the file is sparse (a node that fetched only its layers holds holes,
    which read as zeros without touching the disk), or when all of its first `n_bytes` stay
    cached for other processes (`cold_pieces`), a scratch file of at most SCRATCH_BYTES is
    written in `scratch_dir` (not /tmp, which is often RAM-backed)."""
    if path is not None and _fully_allocated(Path(path)):
        rate = _timed_stream(Path(path), n_bytes, piece_bytes, max_seconds, load)
        if not math.isnan(rate):
            return rate
        # All of it is held in memory by other processes: nothing of it would come from disk.
    # Writing the scratch file costs as much as reading it, and more on a busy disk.
    n_bytes = min(n_bytes, SCRATCH_BYTES)
    scratch_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="disk-probe-", dir=scratch_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            chunk = np.random.default_rng(0).bytes(MiB)
            for _ in range(max(n_bytes // MiB, 1)):
                fh.write(chunk)
            fh.flush()
            # Dirty pages cannot be dropped: write them out first.
            os.fsync(fh.fileno())
        return _timed_stream(Path(name), n_bytes, piece_bytes, max_seconds, load)
    finally:
        os.unlink(name)


def _fully_allocated(path: Path) -> bool:
    st = os.stat(path)
    blocks = getattr(st, "st_blocks", None)
    return blocks is None or blocks * 512 >= st.st_size


def _timed_stream(
    path: Path, n_bytes: int, piece_bytes: int, max_seconds: float, load: Callable[[], None] | None
) -> float:
    with open(path, "rb", buffering=0) as fh:
        fd = fh.fileno()
        length = min(n_bytes, os.fstat(fd).st_size)
        if length <= 0:
            return 0.0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
        else:
            log.debug("no posix_fadvise here: the disk probe may read from the page cache")
        mapped = mmap.mmap(fd, length, prot=mmap.PROT_READ)
        base = np.frombuffer(mapped, dtype=np.uint8)
        try:
            pieces = cold_pieces(base.ctypes.data, length, piece_bytes)
            if not pieces:
                return math.nan
            with _running(load):
                done = 0
                populate = True
                t0 = time.perf_counter()
                elapsed = 0.0
                for span in pieces:
                    if elapsed >= max_seconds:
                        break
                    populate = read_span(fd, base.ctypes.data, span, populate=populate)
                    done += span.n_bytes
                    elapsed = time.perf_counter() - t0
        finally:
            del base
            mapped.close()
    return done / max(elapsed, 1e-9)


def cold_pieces(base: int, length: int, piece_bytes: int) -> list[Span]:
    """The `piece_bytes` pieces of the first `length` bytes mapped at `base` that are not in the
    page cache: pages another process maps stay cached through POSIX_FADV_DONTNEED (daemons on
    one machine profiling the same model file one after another), and reading them would time
    the page cache, not the disk (a second daemon's probe read 2.9 GB/s from a 1.3 GB/s disk)."""
    pieces = []
    for start in range(0, length, piece_bytes):
        span = Span(start, min(start + piece_bytes, length))
        # (a page more: the file's last, partial page stays cached through the advice)
        if mapped_resident_bytes(base, span) <= span.n_bytes // COLD_FRACTION + PAGE:
            pieces.append(span)
    return pieces


@contextmanager
def _running(load: Callable[[], None] | None) -> Iterator[None]:
    """Run `load` over and over in a thread for the duration of the block (started before it:
    the first run has begun when the block starts)."""
    if load is None:
        yield
        return
    stop = threading.Event()
    started = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            started.set()
            load()

    thread = threading.Thread(target=spin, name="prima-disk-probe-load", daemon=True)
    thread.start()
    started.wait()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def compute_load(sizes: ProbeSizes) -> Callable[[], None]:
    """One float32 GEMV of the probe's size: what the disk probe runs beside its reads, as a
    streaming node computes while its prefetch thread reads (numpy releases the GIL)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((sizes.gemv_rows, sizes.gemv_cols), dtype=np.float32)
    x = rng.standard_normal(sizes.gemv_cols, dtype=np.float32)

    def gemv() -> None:
        w @ x

    return gemv


def numpy_gemv_flops(rows: int = 2048, cols: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 matrix-vector product (2 FLOPs per weight), best of `repeats`.
    Decoding one token is a chain of GEMVs, so this, not a GEMM, is the relevant speed."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal(cols, dtype=np.float32)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        w @ x
        best = min(best, time.perf_counter() - t0)
    return 2.0 * rows * cols / max(best, 1e-9)


def measure_formats(
    formats: Iterable[str], kernel_bench: KernelBench, on_format: Callable[[str], None] | None = None
) -> dict[str, float]:
    """FLOP/s per weight format. `F32` is always measured: the cost model falls back to it.
    `on_format` hears each format as its measurement starts."""
    out = {}
    for fmt in dict.fromkeys(["F32", *formats]):
        if on_format:
            on_format(fmt)
        out[fmt] = float(kernel_bench(fmt))
    return out


def profile_device(
    node_id: str | None = None,
    address: str = "",
    *,
    model_path: str | os.PathLike[str] | None = None,
    kernel_bench: KernelBench | None = None,
    accelerator: AcceleratorProfile | None = None,
    net_latency_ms: float = 0.0,
    net_bandwidth_bytes_per_s: float = math.inf,
    sizes: ProbeSizes | None = None,
    scratch_dir: Path = DEFAULT_PROBE_DIR,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> DeviceProfile:
    """Measure this machine. With `model_path` the disk probe reads the model file itself and
    throughput is measured for the model's weight formats; otherwise F32 only. `on_progress`
    hears (steps done, steps in all, the step now) as each measurement starts, then the end."""
    sizes = sizes or ProbeSizes()
    total, usable = usable_ram_bytes()
    swap = psutil.swap_memory()
    formats: list[str] = []
    if model_path is not None:
        with GGUFFile(model_path) as gguf:
            model = ModelProfile.from_gguf(gguf)
        formats = sorted({*model.layer_flops, *model.output_flops})
    if kernel_bench is None:
        # One numpy measurement stands for every format: numpy runs them all as float32.
        gemv = numpy_gemv_flops(sizes.gemv_rows, sizes.gemv_cols, sizes.repeats)
        kernel_bench = lambda _fmt: gemv  # noqa: E731
    n_steps = 2 + len(dict.fromkeys(["F32", *formats]))
    done = 0

    def step(what: str) -> None:
        nonlocal done
        if on_progress:
            on_progress(done, n_steps, what)
        done += 1

    step("disk read")
    disk = measure_disk_read(
        model_path, sizes.disk_bytes, scratch_dir, max_seconds=sizes.disk_seconds, load=compute_load(sizes)
    )
    step("memory bandwidth")
    memory = measure_mem_bandwidth(sizes.mem_bytes, sizes.repeats)
    flops = measure_formats(formats, kernel_bench, lambda fmt: step(f"compute {fmt}"))
    if on_progress:
        on_progress(n_steps, n_steps, "done")
    return DeviceProfile(
        node_id=node_id or socket.gethostname(),
        address=address,
        os=os_class(),
        ram_total_bytes=total,
        ram_available_bytes=usable,
        swap_total_bytes=int(swap.total),
        swap_free_bytes=int(swap.free),
        disk_read_bytes_per_s=disk,
        mem_bandwidth_bytes_per_s=memory,
        cpu_flops=flops,
        accelerator=accelerator,
        net_latency_ms=net_latency_ms,
        net_bandwidth_bytes_per_s=net_bandwidth_bytes_per_s,
    )
