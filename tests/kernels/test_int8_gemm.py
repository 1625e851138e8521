"""q8 prefill's int8 GEMM: each format's unpack step against gguf-py's dequantizer, the GEMM exact
against the quantized activations (as the decode kernels are), on any row and tile split."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.kernels import dispatch, drivers
from prima.kernels import int8_gemm as g8
from prima.kernels import matmul as mm
from prima.kernels.tensor import QTensor

from .weights import FORMATS, random_qtensor, reference, relative_error

Q = GGMLQuantizationType
GEMM_QTYPES = [q for q in FORMATS if int(q) in drivers.GEMM_IDS]
TOL = 1e-5  # float32 rounding of sums of ~1e3 terms, as test_int8_dots' exactness tests


@pytest.fixture(autouse=True)
def _gemm_on_any_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """matmul takes the GEMM only where the CPU has vpdpbusd; these tests run it everywhere (the
    generic build below included)."""
    monkeypatch.setattr(mm, "INT8_GEMM", True)


def _cols(qtype: GGMLQuantizationType) -> int:
    return 512 if qtype.name.endswith("_K") else 160


def _quantized(x: np.ndarray) -> np.ndarray:
    """x as the int8 kernels see it: xd * xq per 32-element block."""
    n, cols = x.shape
    xq, xd, _ = mm.quantize_activations(x)
    return (xq.reshape(n, -1, 32) * xd[:, :, None]).reshape(n, cols).astype(np.float32)


def test_gemm_formats_cover_the_test_models() -> None:
    """Gemma-3 Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0) and SmolLM2 (Q4_1, Q8_0) prefill on the GEMM."""
    assert {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.Q4_1} <= set(GEMM_QTYPES)


@pytest.mark.parametrize("qtype", GEMM_QTYPES, ids=lambda q: q.name)
def test_unpack_equals_reference_dequantization(qtype: GGMLQuantizationType) -> None:
    """sc * u + mn per 16 elements is the weight, to float32 rounding of the affine form."""
    w = random_qtensor(qtype, rows=3, cols=_cols(qtype), seed=11)
    u = np.empty(w.cols, dtype=np.uint8)
    sc = np.empty(w.cols // g8.PIECE, dtype=np.float32)
    mn = np.empty(w.cols // g8.PIECE, dtype=np.float32)
    ref = reference(w)
    for r in range(w.rows):
        dispatch.unpack(int(qtype), w.raw[r], u, sc, mn)
        assert u.max() <= FORMATS[qtype].unpack_max  # what the AVX2 step's int16 runs rely on
        if FORMATS[qtype].unpack_piece == 2 * g8.PIECE:
            np.testing.assert_array_equal(sc[0::2], sc[1::2])
            np.testing.assert_array_equal(mn[0::2], mn[1::2])
        got = np.repeat(sc, g8.PIECE).astype(np.float64) * u + np.repeat(mn, g8.PIECE)
        scale = np.abs(ref[r]).max()
        np.testing.assert_allclose(got, ref[r], rtol=0, atol=scale * 1e-6)


@pytest.mark.parametrize("qtype", GEMM_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [5, 8, 13, 64])
def test_gemm_equals_product_with_quantized_activations(qtype: GGMLQuantizationType, n: int) -> None:
    """Row counts that leave a partial activation group and a partial tile of weight rows."""
    w = random_qtensor(qtype, rows=37, cols=_cols(qtype), seed=3)
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    y = mm.matmul(w, x, int8=True)
    assert y.shape == (n, w.rows)
    assert relative_error(y, _quantized(x), reference(w)) < TOL


@pytest.mark.parametrize(
    "qtype", [q for q in GEMM_QTYPES if int(q) in drivers.INT8_IDS], ids=lambda q: q.name
)
def test_gemm_rows_agree_with_decode_kernels(qtype: GGMLQuantizationType) -> None:
    """A prompt's rows through the GEMM and each row alone through the decode kernel see the same
    int8 activations: they differ only by float32 summation order."""
    w = random_qtensor(qtype, rows=19, cols=_cols(qtype), seed=5)
    x = np.random.default_rng(9).standard_normal((12, w.cols)).astype(np.float32)
    batched = mm.matmul(w, x, int8=True)
    alone = np.concatenate([mm.matmul(w, x[k : k + 1], int8=True) for k in range(x.shape[0])])
    assert relative_error(batched, _quantized(x), reference(w)) < TOL
    assert relative_error(alone, _quantized(x), reference(w)) < TOL
    assert np.abs(batched - alone).max() <= TOL * np.abs(alone).max()


def _saturated_qtensor(qtype: GGMLQuantizationType, fill: int, rows: int, cols: int) -> QTensor:
    """Every quant byte `fill` (0xFF: each format's largest unpacked byte), every f16 scale 0.01."""
    layout = FORMATS[qtype].layout
    n_blocks = rows * cols // layout.elements
    blocks = np.full((n_blocks, layout.nbytes), fill, dtype=np.uint8)
    for off in layout.f16_offsets:
        blocks[:, off : off + 2] = np.full(n_blocks, 0.01, np.float16).view(np.uint8).reshape(n_blocks, 2)
    raw = blocks.reshape(rows, -1)
    raw.flags.writeable = False
    return QTensor("w", qtype, (rows, cols), raw)


EXTREMES = [(q, 0xFF) for q in GEMM_QTYPES] + [(Q.Q8_0, 0x7F), (Q.Q8_0, 0x80)]


@pytest.mark.parametrize(("qtype", "fill"), EXTREMES, ids=lambda v: v.name if hasattr(v, "name") else hex(v))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gemm_holds_the_largest_products(qtype: GGMLQuantizationType, fill: int, sign: float) -> None:
    """The largest bytes a format unpacks against activations that quantize to +-127 everywhere:
    where the GEMM adds byte products in int16 (AVX2's pmaddubsw, in runs that fit), nothing may
    saturate; Q8_0's bytes up to 255 (q = 127) and q = -128 included."""
    w = _saturated_qtensor(qtype, fill, rows=12, cols=_cols(qtype))
    x = np.full((9, w.cols), sign, dtype=np.float32)
    assert relative_error(mm.matmul(w, x, int8=True), _quantized(x), reference(w)) < TOL


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q6_K], ids=lambda q: q.name)
def test_gemm_matmul_many_equals_separate_launches(qtype: GGMLQuantizationType) -> None:
    """Three weights in one launch, with row counts that split tiles across A, B and C: every
    output is computed on its own, so the bits do not depend on where the tiles fall."""
    ws = [random_qtensor(qtype, rows=r, cols=_cols(qtype), seed=r) for r in (21, 5, 30)]
    x = np.random.default_rng(6).standard_normal((9, ws[0].cols)).astype(np.float32)
    expected = np.concatenate([mm.matmul(w, x, int8=True) for w in ws], axis=1)
    np.testing.assert_array_equal(mm.matmul_many(ws, x, int8=True), expected)


def test_exact_mode_batches_stay_exact() -> None:
    """Without int8, long batches keep float activations (dequantized tiles and BLAS)."""
    w = random_qtensor(Q.Q4_K, rows=9, cols=512, seed=7)
    x = np.random.default_rng(8).standard_normal((16, w.cols)).astype(np.float32)
    assert relative_error(mm.matmul(w, x), x, reference(w)) < TOL


def test_cpus_without_vpdpbusd_prefill_on_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GEMM would lose to BLAS (INT8_GEMM off), q8 batches keep float activations."""
    monkeypatch.setattr(mm, "INT8_GEMM", False)
    w = random_qtensor(Q.Q5_0, rows=9, cols=160, seed=7)
    x = np.random.default_rng(8).standard_normal((16, w.cols)).astype(np.float32)
    assert relative_error(mm.matmul(w, x, int8=True), x, reference(w)) < TOL


@pytest.mark.slow
def test_generic_gemm_passes_the_same_tests(tmp_path: Path) -> None:
    """The generic vector code (no vpdpbusd: AVX2-only x86, ARM), compiled for a portable target
    in a fresh numba cache and put through this file's tests."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


GROUP_8_PROBE = """
import sys
import numpy as np
from prima.kernels import int8_gemm as g8
# Before anything compiles (fresh numba cache): the 256-bit layout a CPU with AVX-VNNI but no
# 512-bit vpdpbusd gets.
g8.GROUP, g8.STEP_BYTES, g8.PACKED_BLOCK = 8, 32, 8 * g8.QK8
from prima.kernels import drivers
from tests.kernels.weights import random_qtensor
from gguf import GGMLQuantizationType as Q
w = random_qtensor(Q.Q6_K, rows=40, cols=512, seed=3)
x = np.random.default_rng(4).standard_normal((37, w.cols)).astype(np.float32)
out = np.empty((37, w.rows), dtype=np.float32)
drivers.gemm_q8(int(w.qtype), w.raw, w.raw[:0], w.raw[:0], x, out)
sys.stdout.write(out.tobytes().hex())
"""


@pytest.mark.slow
@pytest.mark.skipif(not g8.VNNI512, reason="this CPU runs the 256-bit GEMM, which the tests above check")
def test_the_256_bit_gemm_gives_the_512_bit_gemms_bits(tmp_path: Path) -> None:
    """Where the CPU has 512-bit vpdpbusd the GEMM packs 16 activation rows per vector; CPUs with
    only 256-bit VNNI pack 8. Each row's lane sees the same operations in the same order, so the
    256-bit layout, built here in a fresh numba cache, gives the same bits."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", GROUP_8_PROBE],
        env={**env, "PYTHONPATH": os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w = random_qtensor(Q.Q6_K, rows=40, cols=512, seed=3)
    x = np.random.default_rng(4).standard_normal((37, w.cols)).astype(np.float32)
    out = np.empty((37, w.rows), dtype=np.float32)
    drivers.gemm_q8(int(w.qtype), w.raw, w.raw[:0], w.raw[:0], x, out)
    assert g8.GROUP == 16
    assert bytes.fromhex(proc.stdout) == out.tobytes()
