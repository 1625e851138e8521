"""numba's thread count is per thread: the count --threads sets where the backend is built does
not reach the daemon's compute thread or the gRPC threads that run a generation."""

from __future__ import annotations


def use_threads(threads: int | None) -> None:
    """Apply --threads to the calling thread (None: leave numba's default)."""
    if threads is None:
        return
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
