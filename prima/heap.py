"""Keep the C allocator's free memory out of resident memory (glibc; elsewhere a no-op).

Building a large structure in Python (a vocabulary index, numba loading kernels) leaves freed
memory in glibc's heap, still resident; peak RSS counts it as if it were in use. `trim()` after
such a step returns it. And glibc gives every thread that allocates its own arena, each keeping
its own freed blocks: prefill's tile threads would each hold their last tiles, megabytes at a
prefill. prima's threads allocate little once a model runs (weights are the mmap; a few arrays
per layer), so `one_arena()` has them share the main one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache
from typing import Any


def trim() -> bool:
    """Return free heap pages to the OS (glibc's malloc_trim); False where that is unavailable."""
    libc = _libc()
    trim_fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim_fn is None:
        return False
    trim_fn(0)
    return True


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_arena() -> bool:
    """Threads that allocate from now on share the main arena (threads that already allocated
    keep theirs); False where mallopt is unavailable."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    return mallopt is not None and mallopt(_M_ARENA_MAX, 1) == 1


@cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
