"""Float weights at decode: float16 widened exactly from their bits, every width read as stored
(no float32 copy per token), each row of a group with the bits it has alone, and the product
equal to numpy's on the same values."""

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

    def spy(a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        calls.append(x.shape[0])
        real(a, b, c, x, out)

    monkeypatch.setattr(drivers, "matvec_f16", spy)
    matmul.matmul(w, np.ones((2, 64), dtype=np.float32))
    matmul.matmul(w, np.ones((matmul.FUSED_MAX_N + 1, 64), dtype=np.float32))
    assert calls == [2]


@pytest.mark.parametrize("kernel", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cols", [576, 100])  # a multiple of the lanes, and a tail
def test_each_row_of_a_group_has_the_bits_of_that_row_alone(kernel: str, cols: int) -> None:
    """Rows go through in groups of 4, 2 and 1 sharing each widened weight; speculative decoding
    relies on a row's bits not depending on how many rows came with it."""
    from prima.kernels import float_weights

    rng = np.random.default_rng(cols)
    weights = rng.standard_normal((37, cols))
    if kernel == "f32":
        matvec, bits = drivers.matvec_f32, weights.astype(np.float32).view(np.uint32)
    else:
        matvec = drivers.matvec_f16 if kernel == "f16" else float_weights.matvec_bf16
        bits = weights.astype(np.float16).view(np.uint16)
    # Values of very different sizes: a sum in another order would round differently.
    x = (rng.standard_normal((7, cols)) * 10.0 ** rng.integers(-3, 4, (7, cols))).astype(np.float32)
    alone = np.empty((7, 37), dtype=np.float32)
    for k in range(7):
        matvec(bits, bits[:0], bits[:0], x[k : k + 1], alone[k : k + 1])
    for n in range(2, 8):
        together = np.empty((n, 37), dtype=np.float32)
        matvec(bits, bits[:0], bits[:0], x[:n], together)
        np.testing.assert_array_equal(
            together.view(np.uint32), alone[:n].view(np.uint32), err_msg=f"{n} rows"
        )


@pytest.mark.parametrize("cols", [576, 100])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_decode_product_of_float32_weights_is_numpys(cols: int, n: int) -> None:
    """float32 weights at decode run drivers.matvec_f32 (BLAS promises nothing per row)."""
    w = np.random.default_rng(cols + n).standard_normal((70, cols)).astype(np.float32)
    raw = w.view(np.uint8).reshape(70, 4 * cols).copy()
    raw.flags.writeable = False
    tensor = QTensor("blk.0.ffn_up.weight", GGMLQuantizationType.F32, (70, cols), raw)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    got = matmul.matmul(tensor, x)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32]
)
def test_three_weights_take_one_launch_with_the_bits_of_each_alone(
    qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v (or gate/up) of float weights run as one launch, as quantized ones do, and each
    weight's columns have the bits of that weight multiplied alone."""
    rng = np.random.default_rng(7)
    dtype = {GGMLQuantizationType.F32: np.float32}.get(qtype, np.float16)
    ws = []
    for i, rows in enumerate((48, 16, 16)):
        values = rng.standard_normal((rows, 96)).astype(dtype)
        if qtype == GGMLQuantizationType.BF16:  # bfloat16: the top half of each float32
            values = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = values.view(np.uint8).reshape(rows, -1).copy()
        raw.flags.writeable = False
        ws.append(QTensor(f"blk.0.w{i}.weight", qtype, (rows, 96), raw))
    x = rng.standard_normal((3, 96)).astype(np.float32)
    launches: list[int] = []
    for module, name in ((drivers, "matvec_f16"), (drivers, "matvec_f32")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real: (launches.append(1), real(*args))[1])
    from prima.kernels import float_weights

    real_bf16 = float_weights.matvec_bf16
    monkeypatch.setattr(float_weights, "matvec_bf16", lambda *args: (launches.append(1), real_bf16(*args))[1])
    together = matmul.matmul_many(ws, x)
    assert launches == [1]
    alone = np.concatenate([matmul.matmul(w, x) for w in ws], axis=1)
    np.testing.assert_array_equal(together.view(np.uint32), alone.view(np.uint32))
