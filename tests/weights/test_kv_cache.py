"""The KV cache of one session: only the owned layers, contiguous writes, a full context named
as such, and rollback (the ring replays a step after a failure by truncating)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prima.errors import ContextFullError
from prima.model.config import ModelConfig
from prima.weights.kv_cache import KVCache, kv_bytes

N_KV_HEADS = 2
HEAD_DIM = 3


def _config(n_layers: int = 6) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        n_layers=n_layers,
        d_model=8,
        n_heads=4,
        n_kv_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        ffn_dim=16,
        vocab_size=32,
        context_length=128,
        norm_eps=1e-5,
        rope_base=10000.0,
        rope_dim=HEAD_DIM,
        rope_type="norm",
        activation="silu",
        attn_scale=1.0,
    )


def _kv(n: int, value: float) -> np.ndarray:
    return np.full((n, N_KV_HEADS, HEAD_DIM), value, dtype=np.float32)


def test_cache_holds_only_the_owned_layers() -> None:
    cache = KVCache(_config(), 10, [4, 2, 3, 2])
    assert cache.layers == (2, 3, 4)
    assert set(cache.k) == set(cache.v) == {2, 3, 4}
    assert all(a.shape == (10, N_KV_HEADS, HEAD_DIM) and a.dtype == np.float16 for a in cache.k.values())
    # K and V, float16 (as llama.cpp keeps them), per owned layer and position.
    assert cache.n_bytes == 3 * 2 * 10 * N_KV_HEADS * HEAD_DIM * 2
    assert kv_bytes(_config(), 10, len(cache.layers)) == cache.n_bytes  # known before allocating
    assert [cache.length(i) for i in cache.layers] == [0, 0, 0]
    with pytest.raises(KeyError):
        cache.length(0)


def test_store_writes_the_rows_and_counts_them() -> None:
    cache = KVCache(_config(), 8, range(2))
    assert cache.store(0, np.arange(0, 3), _kv(3, 1.0), _kv(3, -1.0)) == 3
    assert cache.store(0, np.arange(3, 5), _kv(2, 2.0), _kv(2, -2.0)) == 5
    assert cache.length(0) == 5
    assert cache.length(1) == 0  # each layer keeps its own length
    assert np.array_equal(cache.k[0][:5, 0, 0], [1, 1, 1, 2, 2])
    assert np.array_equal(cache.v[0][:5, 1, 2], [-1, -1, -1, -2, -2])
    assert not cache.k[0][5:].any()
    assert not cache.k[1].any()


def test_reserve_counts_rows_a_kernel_writes_itself() -> None:
    cache = KVCache(_config(), 8, [0])
    assert cache.reserve(0, np.arange(0, 4)) == 4
    assert cache.length(0) == 4
    assert not cache.k[0].any()  # nothing was written by the cache


def test_a_gap_is_refused() -> None:
    cache = KVCache(_config(), 8, [0])
    cache.store(0, np.arange(0, 2), _kv(2, 1.0), _kv(2, 1.0))
    with pytest.raises(ValueError, match="gap after 2"):
        cache.store(0, np.arange(3, 5), _kv(2, 1.0), _kv(2, 1.0))
    assert cache.length(0) == 2


def test_full_context_is_refused_and_says_what_to_do() -> None:
    cache = KVCache(_config(), 4, [0])
    cache.store(0, np.arange(0, 3), _kv(3, 1.0), _kv(3, 1.0))
    with pytest.raises(ContextFullError, match="position 4 does not fit a context of 4 tokens.*--ctx"):
        cache.store(0, np.arange(3, 5), _kv(2, 9.0), _kv(2, 9.0))
    # Nothing was written or counted: the last free row can still be used.
    assert cache.length(0) == 3
    assert not (cache.k[0] == 9.0).any()
    assert cache.store(0, np.array([3]), _kv(1, 4.0), _kv(1, 4.0)) == 4


def test_rewriting_earlier_positions_rolls_back() -> None:
    """A write that starts inside the valid rows replaces them and ends the valid range there."""
    cache = KVCache(_config(), 8, [0])
    cache.store(0, np.arange(0, 6), _kv(6, 1.0), _kv(6, 1.0))
    assert cache.store(0, np.arange(2, 4), _kv(2, 5.0), _kv(2, 5.0)) == 4
    assert cache.length(0) == 4
    assert np.array_equal(cache.k[0][:4, 0, 0], [1, 1, 5, 5])


def test_truncate_forgets_positions_but_never_adds_any() -> None:
    cache = KVCache(_config(), 8, [0, 1])
    cache.store(0, np.arange(0, 6), _kv(6, 1.0), _kv(6, 1.0))
    cache.store(1, np.arange(0, 2), _kv(2, 1.0), _kv(2, 1.0))
    cache.truncate(3)
    assert (cache.length(0), cache.length(1)) == (3, 2)
    with pytest.raises(ValueError, match="gap after 3"):
        cache.store(0, np.arange(4, 5), _kv(1, 1.0), _kv(1, 1.0))
    cache.truncate(0)
    assert (cache.length(0), cache.length(1)) == (0, 0)


def test_rows_are_stored_as_halves_and_seen_as_bits_by_kernels() -> None:
    """float32 keys are rounded to the nearest half as numpy rounds; the uint16 views the
    kernels take are the same memory, and the float32 pair they also take is empty."""
    cache = KVCache(_config(), 4, [0, 1])
    k = np.random.default_rng(1).standard_normal((2, N_KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache.store(1, np.arange(2), k, -k)
    np.testing.assert_array_equal(cache.k[1][:2], k.astype(np.float16))
    k32, v32, k16, v16 = cache.kernel_arrays(1)
    assert k32.size == v32.size == 0
    np.testing.assert_array_equal(v16[:2], (-k).astype(np.float16).view(np.uint16))
    cache.kernel_arrays(0)[2][3, 1, 2] = np.float16(1.5).view(np.uint16)
    assert cache.k[0][3, 1, 2] == 1.5


def test_a_float32_cache_keeps_floats_and_other_dtypes_are_refused() -> None:
    cache = KVCache(_config(), 4, [0], np.float32)
    k = np.full((1, N_KV_HEADS, HEAD_DIM), 0.1, dtype=np.float32)
    cache.store(0, np.array([0]), k, k)
    assert cache.k[0][0, 0, 0] == np.float32(0.1)
    k32, _, k16, _ = cache.kernel_arrays(0)
    assert k32 is cache.k[0]
    assert k16.size == 0
    assert cache.n_bytes == kv_bytes(_config(), 4, 1, np.float32) == 2 * kv_bytes(_config(), 4, 1)
    with pytest.raises(ValueError, match="float16 or float32"):
        KVCache(_config(), 4, [0], np.float64)


def _resident_kib(a: np.ndarray) -> int:
    """KiB of `a`'s pages in memory, from mincore over its mapping (Linux)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = a.ctypes.data - a.ctypes.data % page
    n_pages = (a.ctypes.data + a.nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * n_pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n_pages * page), vec) == 0
    return sum(b & 1 for b in vec) * page // 1024


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_ANONYMOUS"), reason="needs anonymous mappings")
def test_a_session_holds_memory_only_for_the_positions_it_wrote() -> None:
    """A long context costs nothing until used: only the written rows' pages are resident."""
    config = dataclasses.replace(_config(n_layers=1), n_kv_heads=8, head_dim=128)
    cache = KVCache(config, 4096, [0])  # 8 MiB of keys and values
    assert _resident_kib(cache.k[0]) == 0
    rows = np.ones((64, 8, 128), dtype=np.float32)
    cache.store(0, np.arange(64), rows, rows)
    assert 0 < _resident_kib(cache.k[0]) <= 64 * 8 * 128 * 2 // 1024 + 8
