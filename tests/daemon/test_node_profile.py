"""A daemon measuring itself: one decode step through a few real layers gives the ms per layer,
and the kernel speeds are scaled so that the cost model predicts exactly that time per layer.
Time is injected (tests/fake_time.py): nothing here depends on how fast this machine is."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.daemon import node_profile
from prima.errors import ProtocolError
from prima.forward.loader import LoadedModel, load_model
from prima.forward.placement import Piece
from prima.scheduler import device_probe
from prima.scheduler.cost_model import device_cost, gemv_ms
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile
from tests.conftest import tiny_model_path
from tests.fake_time import FakeTime

Measure = Callable[[Callable[[LoadedModel], float]], tuple[DeviceProfile, ModelProfile, dict[str, float]]]
SMALL = device_probe.ProbeSizes(mem_bytes=1 << 20, disk_bytes=1 << 20, gemv_rows=64, gemv_cols=64, repeats=2)


@functools.cache
def _tiny() -> LoadedModel:
    return load_model(tiny_model_path("tiny-qwen2"), mode="exact")


@pytest.fixture
def tiny() -> LoadedModel:
    return _tiny()


@pytest.fixture
def steps(
    monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel
) -> list[tuple[int, int, tuple[int, ...], list[int]]]:
    """(start, end, h shape, positions) of every window run; each "takes" 1 ms."""
    calls: list[tuple[int, int, tuple[int, ...], list[int]]] = []
    run = tiny.model.run

    def spy(piece: Piece, h: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        assert not piece.on_accel
        calls.append((piece.layers.start, piece.layers.stop, h.shape, positions.tolist()))
        return run(piece, h, positions, cache)

    monkeypatch.setattr(tiny.model, "run", spy)
    monkeypatch.setattr(node_profile, "time", FakeTime(1e-3))
    return calls


def _layer_bytes(loaded: LoadedModel) -> int:
    return ModelProfile.from_gguf(loaded.gguf).layer_bytes


@pytest.mark.parametrize(
    ("timed_bytes", "n"),
    [
        (None, 4),  # 48 MiB: more than the tiny model's 4 layers hold, so all of them
        (1, 1),  # at least one layer
        ("2 layers + 1", 3),  # enough whole layers to cover the bytes
    ],
)
def test_layer_time_is_ms_per_layer_of_one_decode_step(
    monkeypatch: pytest.MonkeyPatch,
    tiny: LoadedModel,
    steps: list[tuple[int, int, tuple[int, ...], list[int]]],
    timed_bytes: int | str | None,
    n: int,
) -> None:
    if timed_bytes == "2 layers + 1":
        timed_bytes = 2 * _layer_bytes(tiny) + 1
    if timed_bytes is not None:
        monkeypatch.setattr(node_profile, "TIMED_BYTES", timed_bytes)
    # Each step through the n layers "takes" 1 ms (one clock step between its two readings).
    assert node_profile.time_one_layer(tiny, steps=3) == pytest.approx(1.0 / n)
    d_model = tiny.model.config.d_model
    assert steps == [(0, n, (1, d_model), [pos]) for pos in range(3)]  # one token, one position per step


def test_layer_time_is_the_median_step_after_the_warm_up(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Readings (each moves the clock by this much): the warm-up's start (its end is never read),
    # then start and end of three timed steps of 9, 4 and 6 ms, of which the median counts: a
    # typical token, not the luckiest one.
    readings = [0.0, 0.0, 9e-3, 0.0, 4e-3, 0.0, 6e-3]
    monkeypatch.setattr(node_profile, "time", FakeTime(readings))
    assert node_profile.time_one_layer(tiny, steps=4) == pytest.approx(6.0 / tiny.model.config.n_layers)


def test_output_head_time_is_the_median_step_after_the_warm_up(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits = []
    real = tiny.model.output_logits

    def spy(h: np.ndarray) -> np.ndarray:
        logits.append(h.shape)
        return real(h)

    monkeypatch.setattr(tiny.model, "output_logits", spy)
    # As for a layer: the warm-up's start, then three timed calls of 9, 4 and 6 ms.
    readings = [0.0, 0.0, 9e-3, 0.0, 4e-3, 0.0, 6e-3]
    monkeypatch.setattr(node_profile, "time", FakeTime(readings))
    assert node_profile.time_output_head(tiny, steps=4) == pytest.approx(6.0)
    assert logits == [(1, tiny.model.config.d_model)] * 4  # one token each time


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, smollm2_path: Path) -> Measure:
    """measure_node on SmolLM2 with small probes, a kernel bench with a distinct speed per
    format, and the given layer timer; returns (profile, model, what the bench said)."""
    loaded = load_model(smollm2_path)
    bench: dict[str, float] = {}

    def kernel_flops(fmt: str, **_: object) -> float:
        bench[fmt] = 1e9 * (1 + len(bench))
        return bench[fmt]

    monkeypatch.setattr(node_profile, "kernel_flops", kernel_flops)
    monkeypatch.setattr(
        node_profile, "profile_device", functools.partial(device_probe.profile_device, sizes=SMALL)
    )

    def run(
        time_layer: Callable[[LoadedModel], float],
    ) -> tuple[DeviceProfile, ModelProfile, dict[str, float]]:
        monkeypatch.setattr(node_profile, "time_one_layer", time_layer)
        monkeypatch.setattr(node_profile, "time_output_head", lambda loaded: 3.25)
        return node_profile.measure_node(loaded, "node7"), ModelProfile.from_gguf(loaded.gguf), bench

    return run


def test_kernel_speeds_are_calibrated_to_the_timed_layer(measured: Measure) -> None:
    dev, model, bench = measured(lambda loaded: 7.5)
    assert dev.node_id == "node7"
    assert set(dev.cpu_flops) == set(bench) == {"F32", *model.layer_flops, *model.output_flops}
    assert len(bench) >= 3  # SmolLM2: F32 norms, Q4_1 layers, a Q8_0 head
    # The cost model's time for one layer at the calibrated speeds is the measured one...
    assert gemv_ms(model.layer_flops, dev.cpu_flops) == pytest.approx(7.5)
    # ...and the formats keep the speeds the bench measured relative to each other.
    for fmt in bench:
        assert dev.cpu_flops[fmt] / dev.cpu_flops["F32"] == pytest.approx(bench[fmt] / bench["F32"])


def test_the_timed_output_head_is_the_heads_fixed_cost(measured: Measure) -> None:
    dev, model, _ = measured(lambda loaded: 7.5)
    assert dev.output_ms == 3.25
    assert DeviceProfile.from_dict(dev.to_dict()).output_ms == 3.25  # as a daemon sends it
    assert device_cost(dev, model, is_head=True).fixed_ms == 3.25
    assert device_cost(dev, model, is_head=False).fixed_ms == 0.0
    # Not timed (a profile from before, or a head that could not run): from the head's FLOPs.
    untimed = dataclasses.replace(dev, output_ms=0.0)
    assert device_cost(untimed, model, is_head=True).fixed_ms == pytest.approx(
        gemv_ms(model.output_flops, dev.cpu_flops)
    )


def test_kernel_speeds_stand_when_no_layer_can_be_timed(
    measured: Measure, caplog: pytest.LogCaptureFixture
) -> None:
    def unmappable(loaded: LoadedModel) -> float:
        raise OSError("cannot map")

    with caplog.at_level(logging.WARNING, logger="prima.daemon"):
        dev, _, bench = measured(unmappable)
    assert dev.cpu_flops == bench
    assert "planning from kernel speeds alone" in caplog.text


def test_an_npu_node_profiles_its_accelerator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Through FakeAcl (a stand-in for pyACL: no NPU result): the accelerator's memory is what
    acl.rt.get_mem_info reports, read afresh, and its speed is the timed one-layer window, so the
    cost model's accelerator time per layer is exactly the measured one (time is injected)."""
    pytest.importorskip("onnxruntime")
    from tests.backends.acl.fake_acl import fake_cann

    with fake_cann(tmp_path, memory_bytes=256 << 20) as fake:
        loaded = load_model(tiny_model_path("tiny-qwen3"), backend="acl", mode="exact", npu_ctx=64)
        monkeypatch.setattr(node_profile, "time", FakeTime(2e-3))  # every step "takes" 2 ms
        monkeypatch.setattr(node_profile, "time_one_layer", lambda loaded: 5.0)
        monkeypatch.setattr(node_profile, "time_output_head", lambda loaded: 1.0)
        monkeypatch.setattr(
            node_profile, "profile_device", functools.partial(device_probe.profile_device, sizes=SMALL)
        )
        before = fake.executions
        dev = node_profile.measure_node(loaded, "npu0")
        assert fake.executions - before == node_profile.LAYER_STEPS  # one decode step per run
        assert fake.used_bytes == 0  # the timed window and its KV cache were given back
        accel = dev.accelerator
        assert accel is not None
        assert accel.kind == "acl"
        assert accel.memory_available_bytes == 256 << 20
        model = ModelProfile.from_gguf(loaded.gguf)
        assert gemv_ms(model.layer_flops, accel.flops) == pytest.approx(2.0)
        # Halda's coefficients use it: the NPU's budget and its time per layer next to the CPU's
        cost = device_cost(dev, model, is_head=False)
        assert cost.has_accel
        assert cost.accel_budget_bytes == 256 << 20
        cpu = gemv_ms(model.layer_flops, dev.cpu_flops)
        kv_ms = model.kv_bytes_per_layer / dev.mem_bandwidth_bytes_per_s * 1e3
        assert cost.accel_delta_ms_per_layer == pytest.approx(2.0 - cpu)
        assert cost.cpu_ms_per_layer == pytest.approx(cpu + kv_ms)
        # a node profile reads the device's free memory now, under the cached speeds
        window = loaded.model.backend.load_window(range(0, 2))
        fresh = node_profile.node_profile(loaded, "npu0", "f" * 16, budget_bytes=None, cache_dir=tmp_path)
        assert fresh.device.accelerator is not None
        assert fresh.device.accelerator.memory_available_bytes == (256 << 20) - fake.used_bytes
        loaded.model.backend.release_window(window)
        loaded.model.backend.close()


@pytest.fixture
def profiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[node_profile.NodeProfiler, list[str]]:
    """A NodeProfiler over the tiny model whose measurement records the node it was asked for
    (measuring for real is tested above), caching in `tmp_path`."""
    measured: list[str] = []
    overlapping = threading.Semaphore(1)

    def measure_node(loaded: LoadedModel, node_id: str) -> DeviceProfile:
        if not overlapping.acquire(blocking=False):
            raise AssertionError("two profiles measured at once")
        try:
            measured.append(node_id)
            threading.Event().wait(0.01)  # long enough for another profile to overlap
            return DeviceProfile(node_id, cpu_flops={"F32": 1e9})
        finally:
            overlapping.release()

    monkeypatch.setattr(node_profile, "measure_node", measure_node)
    tiny = _tiny()
    found = node_profile.NodeProfiler(tiny, "f" * 16, budget_bytes=5 << 20, cache_dir=tmp_path)
    return found, measured


def test_a_profiler_measures_the_node_asked_for_once_then_from_its_cache(
    profiler: tuple[node_profile.NodeProfiler, list[str]],
) -> None:
    found, measured = profiler
    first = found.profile("host:7600")
    assert first.device.node_id == "host:7600"
    assert first.mem_budget_bytes == 5 << 20
    assert first.device.ram_total_bytes > 0  # read now, not cached
    assert found.profile("host:7600").device.cpu_flops == {"F32": 1e9}
    assert measured == ["host:7600"]
    found.profile("host:7600", refresh=True)
    assert measured == ["host:7600", "host:7600"]


def test_a_profiler_measures_one_profile_at_a_time(
    profiler: tuple[node_profile.NodeProfiler, list[str]],
) -> None:
    found, measured = profiler
    errors: list[BaseException] = []

    def refresh() -> None:
        try:
            found.profile("n", refresh=True)
        except AssertionError as exc:  # raised in this thread, reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=refresh) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert measured == ["n", "n", "n"]


def test_a_profiler_refuses_a_peer_that_is_no_address(
    profiler: tuple[node_profile.NodeProfiler, list[str]],
) -> None:
    found, measured = profiler
    with pytest.raises(ProtocolError, match="is not host:port"):
        found.profile("n", peer_address="unix:/tmp/x")
    assert measured == []  # refused before anything is measured
