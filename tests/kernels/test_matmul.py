"""Every format's kernels equal x @ dequantize(W).T with gguf-py's dequantizer as the reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.errors import InputError
from prima.kernels import matmul as mm
from prima.kernels.tensor import QTensor

from .weights import ALL_QTYPES, random_qtensor, reference, relative_error

Q = GGMLQuantizationType
TOL = 1e-5


def _cols(qtype: GGMLQuantizationType) -> int:
    return 512 if qtype.name.endswith("_K") else 160  # several blocks per row, not a power of two


@pytest.mark.parametrize("qtype", ALL_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 17, 64])
def test_matmul_equals_reference(qtype: GGMLQuantizationType, n: int) -> None:
    w = random_qtensor(qtype, rows=37, cols=_cols(qtype))
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    y = mm.matmul(w, x)
    assert y.shape == (n, w.rows)
    assert y.dtype == np.float32
    assert relative_error(y, x, reference(w)) < TOL


@pytest.mark.parametrize("qtype", ALL_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 17])
def test_matmul_fallback_equals_reference(qtype: GGMLQuantizationType, n: int) -> None:
    w = random_qtensor(qtype, rows=5, cols=_cols(qtype), seed=1)
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    assert relative_error(mm.matmul_fallback(w, x), x, reference(w)) < TOL


@pytest.mark.parametrize("qtype", ALL_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("row_ids", [[10, 0, 3, 3], [10, 0, 3, 3, 7, 1, 2, 9, 5]], ids=["few", "many"])
def test_get_rows_equals_reference(qtype: GGMLQuantizationType, row_ids: list[int]) -> None:
    """A decode step's few ids (one row at a time on the calling thread) and a prompt's many
    (one parallel launch)."""
    w = random_qtensor(qtype, rows=11, cols=_cols(qtype), seed=2)
    ids = np.array(row_ids)
    expected = reference(w)[ids].astype(np.float32)
    np.testing.assert_allclose(mm.get_rows(w, ids), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mm.get_rows_fallback(w, ids), expected, rtol=1e-6, atol=1e-7)


def test_matmul_tiles_cover_odd_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force several tiles with a ragged last one.
    monkeypatch.setattr(mm, "TILE_ELEMENTS", 3 * 160)
    w = random_qtensor(Q.Q8_0, rows=7, cols=160)
    x = np.random.default_rng(0).standard_normal((9, 160)).astype(np.float32)
    assert relative_error(mm.matmul(w, x), x, reference(w)) < TOL


def test_matmul_rejects_mismatched_activations() -> None:
    w = random_qtensor(Q.Q4_0, rows=3, cols=64)
    with pytest.raises(ValueError, match="do not match"):
        mm.matmul(w, np.zeros((1, 32), np.float32))


def test_get_rows_rejects_out_of_range_ids() -> None:
    w = random_qtensor(Q.Q8_0, rows=3, cols=32)
    with pytest.raises(InputError, match="outside"):
        mm.get_rows(w, np.array([3]))


def test_get_rows_empty_ids() -> None:
    w = random_qtensor(Q.Q8_0, rows=3, cols=32)
    assert mm.get_rows(w, np.array([], dtype=np.int64)).shape == (0, 32)


def test_matmul_unsupported_type_names_tensor() -> None:
    from prima.errors import UnsupportedModelError

    w = QTensor("blk.0.ffn_up.weight", Q.IQ2_XXS, (1, 256), np.zeros((1, 66), np.uint8))
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_up.weight"):
        mm.matmul(w, np.zeros((1, 256), np.float32))


def test_matmul_many_writes_each_weight_into_its_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights that cannot share one launch (here two formats) each write their product into
    their columns of the one output (no per-weight arrays concatenated at the peak of a prefill
    block), with the bits each weight's own matmul gives."""
    ws = [
        random_qtensor(Q.Q4_K, rows=40, cols=512, seed=2),
        random_qtensor(Q.Q6_K, rows=24, cols=512, seed=3),
    ]
    x = np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32)
    targets: list[np.ndarray | None] = []
    one = mm._matmul_one

    def recording(w: QTensor, xs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        targets.append(out)
        return one(w, xs, out)

    monkeypatch.setattr(mm, "_matmul_one", recording)
    y = mm.matmul_many(ws, x)
    assert len(targets) == 2
    assert all(t is not None and np.shares_memory(t, y) for t in targets)
    np.testing.assert_array_equal(y, np.concatenate([one(w, x) for w in ws], axis=1))


@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q6_K, Q.Q6_K), (Q.F32,) * 3, (Q.F16, Q.BF16, Q.F16)])
def test_prefill_tiles_give_the_same_bits_on_any_thread_count(
    qtypes: tuple[Q, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill's weights of unequal sizes (q, k, v) are cut into tiles that the prefill
    threads share: one, two or three threads give the bits of each weight multiplied alone,
    written into its columns of the one output."""
    shapes = [(700, 256), (96, 256), (96, 256)]  # q of two tiles, k and v of one
    monkeypatch.setattr(mm, "TILE_ELEMENTS", 512 * 256)
    ws = [
        random_qtensor(q, rows=r, cols=c, seed=i)
        for i, (q, (r, c)) in enumerate(zip(qtypes, shapes, strict=True))
    ]
    x = np.random.default_rng(5).standard_normal((mm.FUSED_MAX_N + 9, 256)).astype(np.float32)
    monkeypatch.setattr(mm, "_prefill_threads", 1)
    alone = np.concatenate([mm.matmul(w, x) for w in ws], axis=1)
    for threads in (1, 2, 3):
        monkeypatch.setattr(mm, "_prefill_threads", threads)
        np.testing.assert_array_equal(mm.matmul_many(ws, x), alone)
    np.testing.assert_allclose(alone, x @ np.concatenate([reference(w) for w in ws]).T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("rows", "cols"), [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (7, 9)]
)
def test_prefill_tiles_are_few_and_even(rows: int, cols: int) -> None:
    """As few tiles as keep each within TILE_ELEMENTS (the last may be a little shorter), so two
    threads sharing a weight's tiles finish together."""
    tile_rows = mm._tile_rows(rows, cols)
    n_tiles = -(-rows // tile_rows)
    assert tile_rows * cols <= max(mm.TILE_ELEMENTS, cols)
    assert n_tiles == -(-rows // max(1, mm.TILE_ELEMENTS // cols))
    assert rows - (n_tiles - 1) * tile_rows > tile_rows - n_tiles


def test_prefill_tiles_reuse_their_threads_buffer() -> None:
    """A thread dequantizes every tile into one buffer of its own (a fresh array per tile came
    from new pages: page faults), so one thread's tiles share memory and two threads' do not."""
    w = random_qtensor(Q.F16, rows=64, cols=256, seed=1)
    first = mm._dequantize_tile(w, 0, 8)
    second = mm._dequantize_tile(w, 8, 24)
    assert np.shares_memory(first, second)
    np.testing.assert_array_equal(second, reference(w)[8:24])
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(mm._dequantize_tile, w, 24, 40).result()
    assert not np.shares_memory(other, second)
    np.testing.assert_array_equal(other, reference(w)[24:40])
