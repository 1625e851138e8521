"""The float32 building blocks of prima.kernels.lanes that are not about weight formats."""

from __future__ import annotations

import numpy as np
from numba import njit

from prima.kernels.lanes import exp_f32, pairwise_sum32


@njit(cache=True)
def _exp_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)


def test_exp_is_within_one_ulp_over_the_whole_finite_range() -> None:
    """Every float32 result from the smallest normal to the largest finite one, against float64."""
    x = np.linspace(-87.3, 88.72, 2_000_001, dtype=np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    assert _ulps(got, np.exp(x.astype(np.float64))).max() <= 1.0


def test_exp_at_the_edges() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 88.8, 100.0, -87.5, -200.0], dtype=np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    assert np.isnan(got[0])
    np.testing.assert_array_equal(
        got[1:], [np.inf, 0.0, 1.0, 1.0, np.float32(np.e), np.inf, np.inf, 0.0, 0.0]
    )


@njit(cache=True)
def _pairwise(v: np.ndarray) -> np.float32:
    lanes = v.copy()
    return pairwise_sum32(lanes)


def test_pairwise_sum_adds_every_lane_in_halves() -> None:
    v = np.random.default_rng(3).standard_normal(32).astype(np.float32)
    h = v[:16] + v[16:]
    h = h[:8] + h[8:]
    h = h[:4] + h[4:]
    assert _pairwise(v) == (h[0] + h[2]) + (h[1] + h[3])
    assert _pairwise(np.arange(32, dtype=np.float32)) == 496.0
