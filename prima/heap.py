"""Give the C allocator's free pages back to the OS.

Building a large structure in Python (a vocabulary index, numba loading kernels) leaves freed
memory in glibc's heap, still resident; peak RSS counts it as if it were in use. `trim()` after
such a step returns it. Elsewhere (no glibc) it does nothing.
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


@cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
