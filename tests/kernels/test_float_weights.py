"""F16 and BF16 weights: every value widened exactly, bfloat16 products at decode equal to
numpy's on the same weights, and each batch size on the kernel meant for it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.kernels import float_weights as fw
from prima.kernels import matmul
from prima.kernels.tensor import QTensor

Q = GGMLQuantizationType
EVERY_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    # Zeros of both signs, subnormals, normals and infinities, bit for bit.
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_every_half_tile_widens_as_numpy_does() -> None:
    out = np.empty((100, 256), dtype=np.float32)
    fw.widen_f16_tile(EVERY_BITS, 100, out)
    _same_bits(out, EVERY_BITS[100:200].view(np.float16).astype(np.float32))


def test_every_bfloat16_tile_widens_to_the_top_half_of_a_float32() -> None:
    out = np.empty((256, 256), dtype=np.float32)
    fw.widen_bf16_tile(EVERY_BITS, 0, out)
    _same_bits(out, (EVERY_BITS.astype(np.uint32) << 16).view(np.float32))


def _bf16_tensor(rows: int, cols: int, seed: int) -> tuple[QTensor, np.ndarray]:
    """A BF16 weight as mapped from a GGUF (read-only bytes) and its float32 values."""
    w32 = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
    raw = bits.view(np.uint8).reshape(rows, 2 * cols).copy()
    raw.flags.writeable = False
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    return QTensor("blk.0.ffn_up.weight", Q.BF16, (rows, cols), raw), values


@pytest.mark.parametrize("cols", [576, 100])  # a multiple of the 32 lanes, and a tail
@pytest.mark.parametrize("n", [1, 3, matmul.FUSED_MAX_N + 3])
def test_bfloat16_product_is_numpys(cols: int, n: int) -> None:
    """Decode's few rows (matvec_bf16) and a prefill's many (widened tiles and BLAS)."""
    w, values = _bf16_tensor(70, cols, seed=cols + n)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    got = matmul.matmul(w, x)
    want = x.astype(np.float64) @ values.astype(np.float64).T
    assert got.shape == (n, 70)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_each_batch_size_runs_its_kernel(
    qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BF16 decode rows go to matvec_bf16 (F16's to drivers.matvec_f16); a prefill's rows go to
    the compiled tile widening, not numpy's conversion."""
    w, _ = _bf16_tensor(40, 64, seed=1)
    w = QTensor(w.name, qtype, w.shape, w.raw)
    calls: list[str] = []

    def spy(name: str, real: Callable[..., None]) -> Callable[..., None]:
        def call(*args: object) -> None:
            calls.append(name)
            real(*args)

        return call

    monkeypatch.setattr(fw, "matvec_bf16", spy("matvec_bf16", fw.matvec_bf16))
    widen = "widen_f16_tile" if qtype == Q.F16 else "widen_bf16_tile"
    monkeypatch.setattr(fw, widen, spy(widen, getattr(fw, widen)))
    matmul.matmul(w, np.ones((2, 64), dtype=np.float32))
    decode_calls = list(calls)
    matmul.matmul(w, np.ones((matmul.FUSED_MAX_N + 1, 64), dtype=np.float32))
    assert decode_calls == (["matvec_bf16"] if qtype == Q.BF16 else [])
    assert calls[len(decode_calls) :] == [widen]
