"""Layer windows over the mmap: residency is measured (mincore), prefetch reads, and a budget
below the node's layers keeps the resident bytes within it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from prima.errors import PlanError
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from prima.plan import Window
from prima.scheduler.memory import process_major_faults
from prima.weights.window import PAGE, LayerWindows, resident_bytes

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


def _compute(lw: LayerWindows, layer: int) -> None:
    """What the compute thread does: wait for the layer, read every page of it, let it go."""
    lw.before_layer(layer)
    for span in lw._spans[layer]:
        int(lw.gguf.data[span.start : span.end : PAGE].sum())
    lw.after_layer(layer)


def _cold(gguf: GGUFFile, windows: list[Window]) -> None:
    probe = LayerWindows(gguf, ModelWeights(gguf), windows)
    probe.release_all()
    probe.close()


def test_budget_keeps_resident_bytes_within_it(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    windows = [Window(0, 4), Window(10, 14), Window(20, 24)]
    _cold(gguf, windows)
    probe = LayerWindows(gguf, ModelWeights(gguf), windows)
    budget = probe.owned_bytes * 2 // 3
    probe.close()
    lw = LayerWindows(gguf, ModelWeights(gguf), windows, budget_bytes=budget)
    assert lw.limited
    assert 0 < len(lw.pinned) < len(lw.order)
    lw.start()
    passes = 3
    for _ in range(passes):
        for layer in lw.order:
            _compute(lw, layer)
            assert lw.resident_bytes() <= budget + SLACK_BYTES
    res = lw.residency()
    assert res.peak_resident_bytes <= budget + SLACK_BYTES
    # Pinned layers were read once; streamed ones once per pass (the thread may be one ahead).
    pinned = sum(lw._bytes[i] for i in lw.pinned)
    streamed = lw.streamed_bytes_per_pass
    assert streamed == sum(lw._bytes[i] for i in lw.order) - pinned
    assert pinned + passes * streamed <= lw.stats.bytes_read <= pinned + (passes + 1) * streamed
    assert lw.stats.misses == 0
    # Every pinned layer is still in memory.
    assert all(resident_bytes(gguf, s) == s.n_bytes for i in lw.pinned for s in lw._spans[i])
    lw.close()


def test_prefetched_layers_take_no_demand_faults(private_model: Path) -> None:
    """Layers arrive by large reads in the prefetch thread, not by 4 KiB faults during compute."""
    gguf = GGUFFile(private_model)
    windows = [Window(0, 6), Window(12, 18)]
    _cold(gguf, windows)
    lw = LayerWindows(gguf, ModelWeights(gguf), windows, budget_bytes=0)
    pages = lw.owned_bytes // PAGE
    faults = process_major_faults()
    lw.start()
    for layer in lw.order:
        _compute(lw, layer)
    faults = process_major_faults() - faults
    assert lw.resident_bytes() == lw.owned_bytes
    assert lw.stats.bytes_read == sum(lw._bytes.values())
    assert faults < pages // 16, f"{faults} major faults for {pages} pages"
    lw.close()


def test_out_of_order_visit_is_read_again(private_model: Path) -> None:
    """A micro-batch revisiting a streamed layer (pipelined prefill) gets it read back."""
    gguf = GGUFFile(private_model)
    windows = [Window(0, 3), Window(3, 6), Window(6, 9)]
    _cold(gguf, windows)
    probe = LayerWindows(gguf, ModelWeights(gguf), windows)
    budget = probe.owned_bytes // 2
    probe.close()
    lw = LayerWindows(gguf, ModelWeights(gguf), windows, budget_bytes=budget)
    lw.start()
    streamed = [i for i in lw.order if i not in lw.pinned]
    for layer in [*lw.order, streamed[0], streamed[1], *lw.order]:
        _compute(lw, layer)
        assert lw.resident_bytes() <= budget + SLACK_BYTES
    lw.close()


def test_unlimited_prefetch_reads_every_window(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    lw = LayerWindows(gguf, ModelWeights(gguf), [Window(2, 3), Window(5, 6)])
    lw.start()
    for layer in lw.order:
        lw.before_layer(layer)
    assert lw.resident_bytes() == lw.owned_bytes
    assert not lw.limited
    lw.close()


def test_layers_that_all_stay_do_not_wake_the_prefetch_thread(
    private_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every layer of an unlimited node is in, computing them is no news to the prefetch
    thread: woken twice a layer, it took a core from the compute threads (#18)."""
    gguf = GGUFFile(private_model)
    lw = LayerWindows(gguf, ModelWeights(gguf), [Window(0, 10)])
    looks: list[int | None] = []
    next_target = lw._next_target

    def spy() -> int | None:
        looks.append(next_target())
        return looks[-1]

    monkeypatch.setattr(lw, "_next_target", spy)
    lw.start()
    for layer in lw.order:
        lw.before_layer(layer)  # waits for each layer to be read
    before = len(looks)
    for _ in range(5):
        for layer in lw.order:
            lw.before_layer(layer)
            time.sleep(0.002)  # the kernels run without the GIL: a woken thread gets its turn
            lw.after_layer(layer)
            time.sleep(0.002)
    assert lw.resident_bytes() == lw.owned_bytes
    lw.release_all()  # leave the file cold for the tests after this one
    lw.close()  # joins the thread: any wake-up it had is counted by now
    gguf.close()
    # 100 before/after calls; the thread may still wake on its own 1 s timeout and at close.
    assert len(looks) - before <= 3


def test_a_window_computed_as_one_piece_waits_for_all_its_layers(private_model: Path) -> None:
    """before_layers / after_layers bracket a whole piece (a node that does not stream): the
    first waits until every layer of it is read, the second counts the piece's compute time."""
    gguf = GGUFFile(private_model)
    windows = [Window(0, 4), Window(6, 8)]
    _cold(gguf, windows)
    lw = LayerWindows(gguf, ModelWeights(gguf), windows)
    lw.start()
    for window in windows:
        layers = range(window.start, window.end)
        lw.before_layers(layers)
        for layer in layers:
            read = sum(resident_bytes(gguf, s) for s in lw._spans[layer])
            assert read == lw._bytes[layer], f"layer {layer}: {read} of {lw._bytes[layer]} bytes in memory"
        before = lw.stats.compute_ms
        time.sleep(0.02)
        lw.after_layers(layers)
        assert lw.stats.compute_ms - before >= 20
    assert lw.resident_bytes() == lw.owned_bytes
    lw.release_all()
    lw.close()
    gguf.close()


def test_budget_below_one_layer_is_a_plan_error(private_model: Path) -> None:
    gguf = GGUFFile(private_model)
    with pytest.raises(PlanError, match="below one layer"):
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


def test_budget_can_shrink_and_grow_while_running(private_model: Path) -> None:
    """A session's KV cache takes memory from the layers, and gives it back when it closes."""
    gguf = GGUFFile(private_model)
    windows = [Window(i, i + 1) for i in range(8)]
    _cold(gguf, windows)
    lw = LayerWindows(gguf, ModelWeights(gguf), windows, budget_bytes=0)
    owned = lw.owned_bytes
    lw.start()
    for layer in lw.order:
        _compute(lw, layer)
    assert not lw.limited
    lw.set_budget(owned // 2)
    assert lw.limited
    assert 0 < len(lw.pinned) < len(lw.order)
    for _ in range(2):
        for layer in lw.order:
            _compute(lw, layer)
            assert lw.resident_bytes() <= owned // 2 + SLACK_BYTES
    lw.set_budget(owned * 2)
    assert not lw.limited
    for layer in lw.order:
        _compute(lw, layer)
    assert lw.resident_bytes() == owned
    lw.close()
