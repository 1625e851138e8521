"""q8 mode's int8-activation kernels: exact against the quantized activations, and within the
activation-quantization error of the float product."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from llvmlite import binding as llvm
from numba import njit

from prima.kernels import drivers, int8_dots
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


def test_instruction_set_follows_numba_target() -> None:
    """pmaddubsw only where numba compiles for this host and it has AVX2; a portable target
    (NUMBA_CPU_NAME) gets the generic vector code, whatever the host has."""
    if os.environ.get("NUMBA_CPU_NAME"):
        assert not int8_dots.AVX2
    else:
        host_avx2 = "x86" in llvm.get_default_triple() and bool(llvm.get_host_cpu_features().get("avx2"))
        assert int8_dots.AVX2 == host_avx2
    assert int8_dots.LANES == (4 if int8_dots.DOTPROD else 8 if int8_dots.AVX2 else 16)
    assert int8_dots.AVX2 or not int8_dots.VNNI  # vpdpbusd is only used on top of the AVX2 path


@pytest.mark.slow
def test_generic_kernels_pass_the_same_tests(tmp_path: Path) -> None:
    """The generic (non-AVX2) dots, which ARM boards and phones run, compiled here for a portable
    target in a fresh numba cache and put through this file's tests, the row groups'
    (tests/kernels/test_row_groups.py), and the half conversions (tests/kernels/test_lanes.py) by
    bits, as a CPU without F16C converts them."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    lanes_tests = str(Path(__file__).with_name("test_lanes.py"))
    groups_tests = str(Path(__file__).with_name("test_row_groups.py"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            __file__,
            lanes_tests,
            groups_tests,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


@njit(cache=False)
def _halves_to_float(raw: np.ndarray, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        out[i] = int8_dots.f16_at(raw, 2 * i)


def test_f16_scales_convert_exactly() -> None:
    """Every one of the 65536 halves (normals, subnormals, zeros, infinities; NaN stays NaN)
    converts as numpy does, on the hardware path and on the by-bits one of the generic build."""
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, dtype=np.float32)
    _halves_to_float(halves.view(np.uint8), out)
    expected = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))


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


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.F16], ids=lambda q: q.name)
def test_formats_without_int8_kernels_stay_exact(qtype: GGMLQuantizationType) -> None:
    w = random_qtensor(qtype, rows=9, cols=_cols(qtype), seed=7)
    x = np.random.default_rng(8).standard_normal((1, w.cols)).astype(np.float32)
    assert relative_error(mm.matmul(w, x, int8=True), x, reference(w)) < TOL


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [32, 96, 128, 288])
def test_affine_formats_take_any_block_count(qtype: GGMLQuantizationType, cols: int) -> None:
    """Q4_1 and Q5_1 convert the scales of four blocks at a time (row_groups.affine_rows); rows of
    fewer blocks, or of a count that four does not divide, end block by block."""
    w = random_qtensor(qtype, rows=19, cols=cols, seed=cols)
    x = np.random.default_rng(cols).standard_normal((2, cols)).astype(np.float32)
    xq, xd, _ = mm.quantize_activations(x)
    xdq = (xq.reshape(2, -1, 32) * xd[:, :, None]).reshape(2, cols).astype(np.float32)
    assert relative_error(mm.matmul(w, x, int8=True), xdq, reference(w)) < TOL
