"""Layer windows over the mmap: residency is measured (mincore), prefetch reads, and a budget
below the node's layers keeps the resident bytes within it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from prima.errors import PlanError
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from prima.scheduler.plan import Window
from prima.weights.window import PAGE, LayerWindows

# Pages another mapping touches near a span edge (read-around) may stay cached; allow a little.
SLACK_BYTES = 64 * PAGE


@pytest.fixture(scope="module")
def private_model(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy no other process maps, so its page cache reflects only this test."""
    dst = tmp_path_factory.mktemp("window") / "model.gguf"
    shutil.copyfile(smollm2_path, dst)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped from the cache
    os.close(fd)
    return dst


def _touch(lw: LayerWindows, r: int) -> None:
    for span in lw.spans[r]:
        int(lw.gguf.data[span.start : span.end : PAGE].sum())  # fault every page in


def test_budget_keeps_resident_bytes_within_it(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    windows = [Window(0, 4), Window(10, 14), Window(20, 24)]
    probe = LayerWindows(gguf, ModelWeights(gguf), windows)
    sizes = sorted(probe.sizes)
    budget = sizes[1] + sizes[2] + 4 * PAGE  # room for any two of the three windows
    probe.release_all()  # start cold
    probe.close()
    lw = LayerWindows(gguf, ModelWeights(gguf), windows, budget_bytes=budget)
    assert lw.limited
    for step in range(7):
        r = step % 3
        lw.begin(r)
        _touch(lw, r)
        lw.end(r)
        assert lw.resident_bytes() <= budget + SLACK_BYTES
    res = lw.residency()
    assert res.releases >= 4
    assert res.peak_resident_bytes <= budget + SLACK_BYTES
    assert res.peak_resident_bytes >= sizes[0]  # it did hold a whole window
    lw.close()


def test_unlimited_prefetch_reads_every_window(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    lw = LayerWindows(gguf, ModelWeights(gguf), [Window(2, 3), Window(5, 6)])
    lw.prefetch_all()
    for r in range(2):
        _touch(lw, r)
    assert lw.resident_bytes() == lw.owned_bytes
    assert not lw.limited
    lw.close()


def test_budget_below_one_window_is_a_plan_error(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    with pytest.raises(PlanError, match="more rounds"):
        LayerWindows(gguf, ModelWeights(gguf), [Window(0, 5), Window(5, 10)], budget_bytes=PAGE)


def test_span_covers_the_window_tensors(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    weights = ModelWeights(gguf)
    lw = LayerWindows(gguf, weights, [Window(3, 5)])
    for layer in (3, 4):
        lo, hi = gguf.byte_range(weights.layer_tensor_names(layer))
        assert any(s.start <= lo < hi <= s.end for s in lw.spans[0])
    assert all(s.start % PAGE == 0 and s.end % PAGE == 0 for s in lw.spans[0])
    assert lw.sizes[0] >= hi - lo
    lw.close()
