"""A long batch cut into row pieces (prima.forward.row_pieces), each layer's pieces in row order,
gives every row and every cached key and value the bits of the whole batch in one call: what lets
a daemon serve another session's step between two pieces of a layer. Checked on the real test
models in both CPU modes on two threads (so attention and prefill tiles are split between
threads), after a first batch long enough that Gemma-3's sliding-window layers drop keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.backends import get_backend
from prima.backends.modes import MODES
from prima.forward.loader import load_model
from prima.forward.placement import Piece
from prima.forward.row_pieces import piece_rows, row_pieces
from prima.forward.windowed_model import WindowedModel
from prima.model.files import open_model
from prima.weights.kv_cache import KVCache
from tests.conftest import tiny_model_path
from tests.tiny_qwen import TINY_TAGS

BATCH = 300  # rows of the batch that is cut: not a multiple of a piece, so its last piece is longer


def test_pieces_cover_the_rows_in_order_none_shorter_than_a_piece() -> None:
    for n in (128, 191, 192, 300, 2048):
        pieces = row_pieces(n, 64)
        assert pieces[0].start == 0
        assert pieces[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        assert all(p.start % 64 == 0 and 64 <= p.stop - p.start < 128 for p in pieces)
    assert row_pieces(127, 64) == [slice(0, 127)]  # too short to cut
    assert row_pieces(300, 0) == [slice(0, 300)]  # the backend promises nothing
    assert piece_rows(32, 50) == 64
    assert piece_rows(64, 8) == 64
    assert piece_rows(0, 64) == 0


def _layers_through(
    model: WindowedModel, layers: range, h: np.ndarray, positions: np.ndarray, cache: KVCache, rows: int
) -> np.ndarray:
    """h through `layers` one layer at a time, each layer's row pieces in order (as the daemon's
    worker computes a long batch while other sessions wait)."""
    for layer in layers:
        piece = Piece(range(layer, layer + 1), False)
        out = np.empty_like(h)
        for part in row_pieces(len(h), rows):
            out[part] = model.run(piece, h[part], positions[part], cache)
        h = out
    return h


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("tag", "layers", "before"), [("smollm2", range(2), 40), ("gemma3", range(1), 520)])
def test_a_batch_in_row_pieces_has_the_bits_of_the_whole_batch(
    request: pytest.FixtureRequest, tag: str, layers: range, before: int, mode: str
) -> None:
    """`before` tokens prefilled first (Gemma-3's layer 0 sees 512 positions back, so the
    batch's later rows no longer see the first ones), then BATCH more, whole and in pieces of one
    and two attention blocks."""
    path: Path = request.getfixturevalue(f"{tag}_path")
    model = load_model(path, mode=mode, threads=2, layers=layers).model
    unit = model.host.row_piece_unit
    assert unit > 0  # the CPU backend with numba promises pieces
    rng = np.random.default_rng(7)
    ids = rng.integers(0, model.config.vocab_size, before + BATCH)
    positions = np.arange(before + BATCH)
    cache = model.new_cache(before + BATCH, layers)
    model.forward_layers(model.embed(ids[:before]), positions[:before], layers.start, layers.stop, cache)
    h = model.embed(ids[before:])
    tail = positions[before:]
    whole = model.forward_layers(h, tail, layers.start, layers.stop, cache)
    keys = {i: (cache.k[i].copy(), cache.v[i].copy()) for i in layers}
    for rows in (unit, piece_rows(unit, 2 * unit)):
        cache.truncate(before)
        cut = _layers_through(model, layers, h, tail, cache, rows)
        assert len(row_pieces(BATCH, rows)) > 1
        np.testing.assert_array_equal(cut, whole)
        for i in layers:
            np.testing.assert_array_equal(cache.k[i], keys[i][0])
            np.testing.assert_array_equal(cache.v[i], keys[i][1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tag", TINY_TAGS)
def test_the_tiny_models_in_row_pieces_give_the_whole_batch(tag: str, mode: str) -> None:
    """The same on the tiny Qwen models (F32 weights: one BLAS product per projection, and so
    small that a piece of 32 rows took OpenBLAS's small-matrix kernel, hence the unit of 64),
    every layer, a last piece one and a half units long and a bit."""
    backend = get_backend("cpu", open_model(tiny_model_path(tag)).weights, threads=2, mode=mode)
    unit = backend.row_piece_unit
    n = 2 * unit + unit // 2 + 3
    layers = range(backend.config.n_layers)
    h0 = backend.embed(np.random.default_rng(3).integers(0, backend.config.vocab_size, n))
    positions = np.arange(n)
    windows = [backend.load_window(range(i, i + 1)) for i in layers]
    whole = h0
    kv = backend.new_kv(n, layers)
    for window in windows:
        whole = backend.run_window(window, whole, positions, kv)
    kv = backend.new_kv(n, layers)
    h = h0
    for window in windows:
        out = np.empty_like(h)
        for part in row_pieces(n, unit):
            out[part] = backend.run_window(window, h[part], positions[part], kv)
        h = out
    np.testing.assert_array_equal(h, whole)
