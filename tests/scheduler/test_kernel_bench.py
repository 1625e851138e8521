"""The kernel bench times prima's own matmul per weight format and refuses formats it cannot run.

Time is injected (tests/fake_time.py), so every throughput is checked exactly: the work of one
call (2 FLOPs per weight, the cost model's count) over the best timed call, never a measured
number."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from gguf import quants as gguf_quants

from prima.errors import InputError
from prima.kernels.matmul import matmul
from prima.kernels.quants import SUPPORTED_QTYPES, row_bytes
from prima.kernels.tensor import QTensor
from prima.scheduler import kernel_bench
from prima.scheduler.cost_model import gemv_ms
from prima.scheduler.kernel_bench import calibrate_to_layer, kernel_flops, synthetic_weight
from tests.fake_time import FakeTime

FORMATS = sorted(q.name for q in SUPPORTED_QTYPES)


class TimedMatmul:
    """matmul that "takes" the next of `durations_s` on the fake clock and records its shapes."""

    def __init__(self, clock: FakeTime, durations_s: list[float]) -> None:
        self.clock = clock
        self.durations_s = list(durations_s)
        self.calls: list[tuple[str, tuple[int, int], tuple[int, ...]]] = []

    def __call__(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        self.calls.append((w.qtype.name, w.shape, x.shape))
        self.clock.advance(self.durations_s[min(len(self.calls), len(self.durations_s)) - 1])
        return np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> TimedMatmul:
    clock = FakeTime()
    fake = TimedMatmul(clock, [1.0])
    monkeypatch.setattr(kernel_bench, "time", clock)
    monkeypatch.setattr(kernel_bench, "matmul", fake)
    return fake


def test_kernel_flops_is_the_work_over_the_best_timed_call(timed: TimedMatmul) -> None:
    timed.durations_s = [100.0, 0.5, 0.2, 0.3]  # the first call warms up and is not timed
    flops = kernel_flops("Q4_K", rows=64, cols=512, repeats=3, budget_s=10.0)
    assert flops == pytest.approx(2 * 64 * 512 / 0.2)
    # One decode row against a (rows, cols) weight of the format asked for, every time.
    assert timed.calls == [("Q4_K", (64, 512), (1, 512))] * 4


def test_kernel_flops_stops_timing_once_past_its_budget(timed: TimedMatmul) -> None:
    timed.durations_s = [1.0, 1.0, 1.0, 1.0, 0.001]
    flops = kernel_flops("F32", rows=8, cols=256, repeats=10, budget_s=2.5)
    assert len(timed.calls) == 1 + 3  # the third timed call ends past the budget
    assert flops == pytest.approx(2 * 8 * 256 / 1.0)


def test_kernel_flops_times_at_least_one_call(timed: TimedMatmul) -> None:
    timed.durations_s = [1.0, 0.25]
    assert kernel_flops("F16", rows=8, cols=256, repeats=0) == pytest.approx(2 * 8 * 256 / 0.25)
    assert len(timed.calls) == 2


def test_cost_model_time_of_the_benched_gemv_is_the_timed_call(timed: TimedMatmul) -> None:
    """Units agree: the cost model's ms for the bench's own work at the measured FLOP/s is the
    best timed call in ms (the profile's throughputs plan real layers this way)."""
    timed.durations_s = [1.0, 0.004]
    flops = kernel_flops("Q6_K", rows=64, cols=512, repeats=1)
    assert gemv_ms({"Q6_K": 2.0 * 64 * 512}, {"Q6_K": flops}) == pytest.approx(4.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_flops_runs_the_real_kernel_of_each_format(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    clock = FakeTime(1e-3)  # each reading 1 ms after the last: every timed call "takes" 1 ms
    monkeypatch.setattr(kernel_bench, "time", clock)
    assert kernel_flops(fmt, rows=8, cols=256, repeats=2) == pytest.approx(2 * 8 * 256 / 1e-3)
    assert clock.readings == 1 + 2 * 2  # the deadline, then start and end of each timed call


@pytest.mark.parametrize("fmt", FORMATS)
def test_synthetic_weight_is_finite_and_computed_as_gguf_py_reads_it(fmt: str) -> None:
    """The bench's weight bytes are valid numbers in every format (no NaN or infinity), and
    prima's matmul computes on them what gguf-py decodes (for Q4_K the fill pattern
    decodes to zeros: the kernels do the same work whatever the values)."""
    w = synthetic_weight(fmt, rows=4, cols=256)
    assert w.shape == (4, 256)
    assert w.raw.shape == (4, row_bytes(w.qtype, 256))
    dense = gguf_quants.dequantize(w.raw, w.qtype).reshape(4, 256).astype(np.float64)
    assert np.isfinite(dense).all()
    x = np.ones((1, 256), dtype=np.float32)
    np.testing.assert_allclose(matmul(w, x)[0], dense.sum(axis=1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("fmt", "words"), [("Q9_Z", "unknown weight format"), ("IQ2_XXS", "no kernel")])
def test_kernel_bench_refuses_what_it_cannot_run(fmt: str, words: str) -> None:
    with pytest.raises(InputError, match=words):
        synthetic_weight(fmt)


def test_calibration_makes_the_cost_model_layer_time_the_measured_one(make_device, make_model) -> None:
    model = make_model()
    dev = make_device("n", gflops=20.0)
    before = gemv_ms(model.layer_flops, dev.cpu_flops)
    after = calibrate_to_layer(dev, model, layer_ms=before * 3)
    assert gemv_ms(model.layer_flops, after.cpu_flops) == pytest.approx(before * 3)


def test_calibration_keeps_the_formats_relative_speeds(make_device, make_model) -> None:
    dev = dataclasses.replace(make_device("n"), cpu_flops={"F32": 1e9, "Q4_K": 4e9, "Q6_K": 3e9})
    after = calibrate_to_layer(dev, make_model(), layer_ms=123.0)
    assert after.cpu_flops["F32"] != dev.cpu_flops["F32"]
    assert after.cpu_flops["Q4_K"] / after.cpu_flops["F32"] == pytest.approx(4.0)
    assert after.cpu_flops["Q6_K"] / after.cpu_flops["Q4_K"] == pytest.approx(0.75)
    assert dataclasses.replace(after, cpu_flops=dev.cpu_flops) == dev  # nothing else changes


@pytest.mark.parametrize("layer_ms", [0.0, -1.0, math.nan])
def test_calibration_without_a_usable_time_changes_nothing(make_device, make_model, layer_ms: float) -> None:
    dev = make_device("n")
    assert calibrate_to_layer(dev, make_model(), layer_ms=layer_ms) == dev
