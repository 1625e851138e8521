"""The kernel bench times prima's own matmul per weight format and refuses formats it cannot run."""

from __future__ import annotations

import pytest

from prima.errors import InputError
from prima.kernels.quants import row_bytes
from prima.scheduler.cost_model import gemv_ms
from prima.scheduler.kernel_bench import calibrate_to_layer, kernel_flops, synthetic_weight


@pytest.mark.parametrize("fmt", ["F32", "Q4_1", "Q4_K"])
def test_kernel_flops_is_positive_for_each_format(fmt: str) -> None:
    assert kernel_flops(fmt, rows=64, cols=256, repeats=2) > 0


def test_synthetic_weight_has_the_format_geometry() -> None:
    w = synthetic_weight("Q8_0", rows=8, cols=64)
    assert w.shape == (8, 64)
    assert w.raw.shape == (8, row_bytes(w.qtype, 64))


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
    assert calibrate_to_layer(dev, model, layer_ms=0.0) == dev
