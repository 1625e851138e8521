"""heap.trim: freed C heap memory goes back to the OS (Linux/glibc), a no-op elsewhere."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from prima import heap
from tests.conftest import run_python


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_freed_heap_pages() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    # 64 KiB blocks (below malloc's mmap threshold: from the heap), each followed by a small one
    # kept allocated, so that freeing them leaves holes that free() itself cannot give back.
    blocks, kept = [], []
    for _ in range(256):
        blocks.append(libc.malloc(64 * 1024))
        kept.append(libc.malloc(2048))
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    for b in blocks:
        libc.free(b)
    before = _rss_kib()
    assert heap.trim()
    assert before - _rss_kib() > 8 * 1024  # most of the 16 MiB freed went back
    for k in kept:
        libc.free(k)


THREAD_ARENAS = """
import threading
import numpy as np
from prima import heap

assert heap.one_arena()
seen = []


def allocate() -> None:
    a = np.ones(8 * 1024, dtype=np.float32)  # 32 KiB: below the mmap threshold, from an arena
    seen.append(a.__array_interface__["data"][0])


for _ in range(4):
    t = threading.Thread(target=allocate)
    t.start()
    t.join()
arenas = set()
for line in open("/proc/self/maps"):
    start, end = (int(x, 16) for x in line.split()[0].split("-"))
    if any(start <= p < end for p in seen):
        arenas.add(line.split()[-1] if len(line.split()) > 5 else "anon")
print(sorted(arenas))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_one_arena_keeps_threads_allocations_in_the_main_heap() -> None:
    done = run_python(THREAD_ARENAS, timeout=120)
    assert done.stdout.strip() == "['[heap]']"
