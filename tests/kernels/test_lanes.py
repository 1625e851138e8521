"""The float32 building blocks of prima.kernels.lanes that are not about weight formats."""

from __future__ import annotations

import numpy as np
from numba import njit

from prima.kernels.lanes import exp_f32, half_to_f32, pairwise_sum32, round_to_half, widen_half


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


@njit(cache=True)
def _widen_all(bits: np.ndarray, by_instruction: np.ndarray, by_arithmetic: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        by_instruction[i] = half_to_f32(bits[i])
        by_arithmetic[i] = widen_half(bits[i])


def test_every_half_widens_exactly_either_way() -> None:
    """half_to_f32 (the CPU's instruction where it has one) and widen_half (bit arithmetic)
    against numpy for all 65536 halves, NaNs included."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    by_instruction, by_arithmetic = np.empty(bits.shape, np.float32), np.empty(bits.shape, np.float32)
    _widen_all(bits, by_instruction, by_arithmetic)
    nan = np.isnan(want)
    for got in (by_instruction, by_arithmetic):
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
        assert np.isnan(got[nan]).all()


@njit(cache=True)
def _round_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = round_to_half(x[i])


def test_round_to_half_is_numpys_rounding() -> None:
    x = (
        np.random.default_rng(5).standard_normal(50_000)
        * 10.0 ** np.random.default_rng(6).uniform(-8, 4, 50_000)
    ).astype(np.float32)
    got = np.empty_like(x)
    _round_all(x, got)
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
