"""q8 mode's int8-activation kernels: exact against the quantized activations, and within the
activation-quantization error of the float product."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.kernels import drivers
from prima.kernels import matmul as mm

from .weights import ALL_QTYPES, random_qtensor, reference, relative_error

Q = GGMLQuantizationType
INT8_QTYPES = [q for q in ALL_QTYPES if int(q) in drivers.INT8_IDS]
# Per element, |x - xd * xq| <= xd / 2 = max|x in block| / 254; over a dot of Gaussian activations
# the errors partly cancel, and relative to sum |x||w| they stay well under this bound.
Q8_TOL = 5e-3
TOL = 1e-5


def _cols(qtype: GGMLQuantizationType) -> int:
    return 512 if qtype.name.endswith("_K") else 160


def test_int8_formats_are_the_test_models_formats() -> None:
    assert {Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K} <= set(INT8_QTYPES)


def test_quantize_activations_round_trip() -> None:
    x = np.random.default_rng(0).standard_normal((2, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block gets scale 0, not a division by zero
    xq, xd, xs = mm.quantize_activations(x)
    assert xq.dtype == np.int8
    assert xd.shape == xs.shape == (2, 3)
    back = xq.reshape(2, 3, 32) * xd[:, :, None]
    assert np.all(np.abs(back.reshape(2, 96) - x) <= xd.repeat(32, axis=1) / 2 + 1e-7)
    assert np.allclose(xs, xd * xq.reshape(2, 3, 32).sum(axis=2, dtype=np.int32))
    assert xd[1, 1] == 0.0
    assert not xq[1, 32:64].any()


@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3])
def test_q8_matvec_equals_product_with_quantized_activations(qtype: GGMLQuantizationType, n: int) -> None:
    """The integer dots are exact: q8 mode computes W @ (xd * xq) to float32 rounding."""
    w = random_qtensor(qtype, rows=37, cols=_cols(qtype), seed=3)
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    xq, xd, _ = mm.quantize_activations(x)
    xdq = (xq.reshape(n, -1, 32) * xd[:, :, None]).reshape(n, w.cols).astype(np.float32)
    y = mm.matmul(w, x, int8=True)
    assert y.shape == (n, w.rows)
    assert relative_error(y, xdq, reference(w)) < TOL


@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=lambda q: q.name)
def test_q8_matvec_is_close_to_exact(qtype: GGMLQuantizationType) -> None:
    w = random_qtensor(qtype, rows=37, cols=_cols(qtype), seed=4)
    x = np.random.default_rng(5).standard_normal((1, w.cols)).astype(np.float32)
    assert relative_error(mm.matmul(w, x, int8=True), x, reference(w)) < Q8_TOL


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_q8_matmul_many_covers_every_weight(qtype: GGMLQuantizationType) -> None:
    """Three weights in one launch, with row counts that split work chunks across A, B and C."""
    ws = [random_qtensor(qtype, rows=r, cols=_cols(qtype), seed=r) for r in (21, 5, 30)]
    x = np.random.default_rng(6).standard_normal((2, ws[0].cols)).astype(np.float32)
    expected = np.concatenate([mm.matmul(w, x, int8=True) for w in ws], axis=1)
    np.testing.assert_array_equal(mm.matmul_many(ws, x, int8=True), expected)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.F16], ids=lambda q: q.name)
def test_formats_without_int8_kernels_stay_exact(qtype: GGMLQuantizationType) -> None:
    w = random_qtensor(qtype, rows=9, cols=_cols(qtype), seed=7)
    x = np.random.default_rng(8).standard_normal((1, w.cols)).astype(np.float32)
    assert relative_error(mm.matmul(w, x, int8=True), x, reference(w)) < TOL
