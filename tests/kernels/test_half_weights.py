"""float16 weights at decode: widened exactly from their bits, read as stored (no float32 copy
per token), and the product equal to numpy's on the same halves."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from numba import njit

from prima.kernels import drivers, matmul
from prima.kernels.lanes import widen_half
from prima.kernels.tensor import QTensor


@njit(cache=False)
def _widen_all(bits: np.ndarray, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        out[i] = widen_half(bits[i])


def test_every_half_widens_to_numpys_float32() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(bits.shape[0], dtype=np.float32)
    _widen_all(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    # Every value bit for bit: zeros of both signs, subnormals, normals, infinities.
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _half_tensor(rows: int, cols: int, seed: int) -> tuple[QTensor, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float16)
    raw = w.view(np.uint8).reshape(rows, 2 * cols).copy()
    raw.flags.writeable = False  # as mapped from a GGUF
    return QTensor("blk.0.ffn_up.weight", GGMLQuantizationType.F16, (rows, cols), raw), w


@pytest.mark.parametrize("cols", [576, 100])  # a multiple of the 32 lanes, and a tail
@pytest.mark.parametrize("n", [1, 3, 4])
def test_decode_product_of_half_weights_is_numpys(cols: int, n: int) -> None:
    w, halves = _half_tensor(70, cols, seed=cols + n)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    got = matmul.matmul(w, x)
    want = x.astype(np.float64) @ halves.astype(np.float64).T
    assert got.shape == (n, 70)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_decode_rows_run_the_half_kernel_not_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows go to drivers.matvec_f16; a prefill's many rows still go to the BLAS tiles."""
    w, _ = _half_tensor(40, 64, seed=1)
    calls: list[int] = []
    real = drivers.matvec_f16

    def spy(a: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        calls.append(x.shape[0])
        real(a, x, out)

    monkeypatch.setattr(drivers, "matvec_f16", spy)
    matmul.matmul(w, np.ones((2, 64), dtype=np.float32))
    matmul.matmul(w, np.ones((matmul.FUSED_MAX_N + 1, 64), dtype=np.float32))
    assert calls == [2]
