"""Prefill attention (BLAS products around a compiled softmax) against the float32 reference."""

from __future__ import annotations

import numpy as np
import pytest

from prima.kernels import matmul as mm
from prima.kernels import ops_reference as ops
from prima.kernels import prefill_attention as pa

# Over a cache of halves the weights are rounded to halves: an exponential one float32 ulp away
# from the reference's can round its weight to the next half (2^-11 of it), so results agree to
# the halves' precision times a value's size, not float32's.
HALVES_TOL = {"rtol": 1e-4, "atol": 5e-5}


def _case(
    n: int, t: int, heads: int, kv_heads: int, hd: int, spread: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """n query rows, the last of them at position t - 1, over a float16 cache of t + 3 rows
    whose rows past t are NaN (never to be read); `spread` scales the queries, so the scores."""
    rng = np.random.default_rng(seed)
    kc = rng.standard_normal((t + 3, kv_heads, hd)).astype(np.float16)
    vc = rng.standard_normal((t + 3, kv_heads, hd)).astype(np.float16)
    kc[t:] = np.nan
    vc[t:] = np.nan
    q = (rng.standard_normal((n, heads, hd)) * spread).astype(np.float32)
    return q, kc, vc, np.arange(t - n, t)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "t", "hd"), [(8, 8, 64), (45, 300, 64), (70, 70, 80)])
def test_matches_the_reference_over_a_cache_of_halves(
    window: int, threads: int, n: int, t: int, hd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows in several blocks and thread spans, a whole prompt (t == n) or new rows after cached
    ones, a sliding window, head dims with and without a tail of the softmax's lanes."""
    monkeypatch.setattr(mm, "_prefill_threads", threads)
    q, kc, vc, positions = _case(n, t, 6, 2, hd, spread=1.0)
    got = pa.prefill_attention(q, kc, vc, t, positions, hd**-0.5, window)
    want = ops.attention(
        q, kc[:t].astype(np.float32), vc[:t].astype(np.float32), positions, hd**-0.5, window, halves=True
    )
    np.testing.assert_allclose(got, want, **HALVES_TOL)


def test_matches_the_reference_over_a_float32_cache() -> None:
    """Exact mode's float32 keys and values: no rounding to halves anywhere."""
    q, kc, vc, positions = _case(40, 90, 4, 4, 32, spread=1.0)
    k32, v32 = kc.astype(np.float32), vc.astype(np.float32)
    got = pa.prefill_attention(q, k32, v32, 90, positions, 0.2, 0)
    want = ops.attention(q, k32[:90], v32[:90], positions, 0.2, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_peaked_scores_whose_weights_underflow() -> None:
    """Scores hundreds apart (a long context's usual shape, exaggerated): weights that underflow
    are 0, not subnormal, and the result is still the reference's."""
    q, kc, vc, positions = _case(33, 400, 4, 2, 64, spread=60.0, seed=3)
    got = pa.prefill_attention(q, kc, vc, 400, positions, 0.125, 0)
    want = ops.attention(
        q, kc[:400].astype(np.float32), vc[:400].astype(np.float32), positions, 0.125, 0, halves=True
    )
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **HALVES_TOL)


def test_causal_softmax_weights_only_the_keys_a_row_may_see() -> None:
    """Each row: zeros after its own position and `window` or more behind it, a distribution
    over the rest, the largest score's key weighted most."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((3, 4, 20)).astype(np.float32)
    raw = scores.copy()
    rel = np.array([5, 9, 14, 19])
    pa.causal_softmax(scores, rel, np.float32(0.5), 4, False)
    for i, p in enumerate(rel):
        seen = slice(p - 3, p + 1)
        assert not scores[:, i, : p - 3].any()
        assert not scores[:, i, p + 1 :].any()
        np.testing.assert_allclose(scores[:, i, seen].sum(axis=-1), 1.0, rtol=1e-6)
        np.testing.assert_array_equal(scores[:, i, seen].argmax(axis=-1), raw[:, i, seen].argmax(axis=-1))


def test_widen_halves_is_numpys_conversion() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(-1, 4, 8)
    np.testing.assert_array_equal(pa.widen_halves(bits), bits.view(np.float16).astype(np.float32))


@pytest.mark.parametrize("window", [0, 40])
def test_a_batch_in_pieces_of_whole_blocks_attends_as_the_whole_batch(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bit for bit, whatever the thread count: a row's result depends on its block alone, which
    is what lets a long batch give way to other sessions between pieces (prima.forward.row_pieces)."""
    q, kc, vc, positions = _case(100, 300, 6, 2, 64, spread=3.0, seed=9)
    monkeypatch.setattr(mm, "_prefill_threads", 2)
    whole = pa.prefill_attention(q, kc, vc, 300, positions, 0.125, window)
    monkeypatch.setattr(mm, "_prefill_threads", 1)
    cuts = [0, pa.BLOCK_ROWS, 3 * pa.BLOCK_ROWS, 100]
    pieces = [
        pa.prefill_attention(q[a:b], kc, vc, int(positions[b - 1]) + 1, positions[a:b], 0.125, window)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
