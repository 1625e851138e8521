"""The numba attention kernels (prima.kernels.attention_compiled) against the numpy reference
ops.attention: decode's per-head kernel, serial or parallel, over halves or float32; prefill's
batched matmuls; the cache writes; and where decode attention goes parallel."""

from __future__ import annotations

import numpy as np
import pytest

from prima.kernels import attention_compiled
from prima.kernels import matmul as mm
from prima.kernels import ops_reference as ops


@pytest.fixture
def rng() -> np.random.Generator:
    """The same draws for a test however the tests are selected or ordered."""
    return np.random.default_rng(7)


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _f16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """A KV cache's rows: halves, as prima.weights.kv_cache stores them."""
    return _f32(rng, *shape).astype(np.float16)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("parallel_min", [0, 1 << 30])
@pytest.mark.parametrize("hd", [16, 64, 80])
def test_attention_matches_reference(
    window: int, parallel_min: int, hd: int, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """Heads in parallel or not, head dims of whole score-lane blocks, a tail, or both."""
    monkeypatch.setattr(attention_compiled, "attention_parallel_min", lambda threads: parallel_min)
    t, heads, kv_heads = 9, 4, 2
    kc, vc = _f16(rng, t, kv_heads, hd), _f16(rng, t, kv_heads, hd)
    positions = np.array([6, 7, 8])
    q = _f32(rng, 3, heads, hd)
    got = attention_compiled.attention(q, kc, vc, t, positions, 0.25, window)
    want = ops.attention(
        q, kc.astype(np.float32), vc.astype(np.float32), positions, 0.25, window, halves=True
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_attention_equals_per_pair_kernel(
    window: int, threads: int, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """A prompt's second micro-batch (queries after cached keys) through the batched matmuls,
    split between threads and cut to the sliding window, against the decode kernel's loop."""
    monkeypatch.setattr(mm, "_prefill_threads", threads)
    t, heads, kv_heads, hd = 29, 4, 2, 16
    kc, vc = _f16(rng, 32, kv_heads, hd), _f16(rng, 32, kv_heads, hd)  # rows past t must not be read
    kc[t:] = np.nan
    positions = np.arange(t - attention_compiled.ATTENTION_BATCHED_MIN_ROWS - 2, t)
    q = _f32(rng, positions.size, heads, hd)
    got = attention_compiled.attention(q, kc, vc, t, positions, 0.25, window)
    want = attention_compiled._attention_serial(q, *ops.cache_forms(kc, vc), t, positions, 0.25, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_reads_a_float32_cache_as_well(rng: np.random.Generator) -> None:
    """Exact mode keeps float32 keys and values: the same kernel, the same result as the numpy
    reference; any other dtype is refused by name."""
    t, heads, kv_heads, hd = 9, 4, 2, 48
    kc, vc, q = _f32(rng, t, kv_heads, hd), _f32(rng, t, kv_heads, hd), _f32(rng, 2, heads, hd)
    positions = np.array([7, 8])
    np.testing.assert_allclose(
        attention_compiled.attention(q, kc, vc, t, positions, 0.25, 0),
        ops.attention(q, kc, vc, positions, 0.25, 0),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(TypeError, match="float16 or float32"):
        attention_compiled.attention(q, kc.astype(np.float64), vc, t, positions, 0.25, 0)


def test_store_half_rounds_as_numpy(rng: np.random.Generator) -> None:
    x = _f32(rng, 3, 40) * 100
    out = np.zeros((3, 40), dtype=np.uint16)
    attention_compiled.store_half(x, out)
    np.testing.assert_array_equal(out.view(np.float16), x.astype(np.float16))


def test_decode_attention_goes_parallel_only_where_a_launch_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread never launches; sleeping workers (woken through the kernel) need far more keys
    than spinning ones."""
    assert attention_compiled.attention_parallel_min(1) == attention_compiled.NEVER
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    sleeping = attention_compiled.attention_parallel_min(2)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    spinning = attention_compiled.attention_parallel_min(2)
    assert (sleeping, spinning) == (
        attention_compiled.ATTENTION_PARALLEL_MIN_SLEEPING,
        attention_compiled.ATTENTION_PARALLEL_MIN_SPINNING,
    )
    assert spinning < sleeping
