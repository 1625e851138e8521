"""ATC takes minutes on a board and a coordinator's calls have deadlines, so no request runs it:
the acl backend compiles the profile's window when it is made, primad compiles the windows a
plan may give its NPU (--npu-window) before it is ready, and from then on the backend loads
compiled windows only. The stand-in ATC here is slow and logs every run, so a run inside a
request would show (through FakeAcl: no NPU result)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.daemon import node_profile
from prima.engine.ahead_of_time import compile_ahead
from prima.engine.generate import GenerateRequest
from prima.engine.sampling import SamplerConfig
from prima.errors import PrimaError
from prima.forward.loader import load_model
from prima.plan import plan_from_window_sizes
from prima.scheduler import device_probe
from prima.scheduler.profile_cache import CACHE_ENV as PROFILE_CACHE_ENV
from tests.conftest import load_tiny_oracle, tiny_model_path
from tests.fake_time import FakeTime

pytest.importorskip("onnxruntime")

from prima.backends.acl.backend import WindowNotCompiledError
from tests.backends.acl.fake_acl import (
    FAKE_ATC_LOG_ENV,
    FAKE_ATC_SECONDS_ENV,
    fake_cann,
    standin_env,
)

TAG = "tiny-qwen3"
N_LAYERS = 4
SMALL = device_probe.ProbeSizes(mem_bytes=1 << 20, disk_bytes=1 << 20, gemv_rows=64, gemv_cols=64, repeats=2)


def _atc_runs(log: Path) -> int:
    return len(log.read_text(encoding="utf-8").splitlines()) if log.exists() else 0


def test_the_profile_never_runs_atc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "atc.log"
    monkeypatch.setenv(FAKE_ATC_LOG_ENV, str(log))
    monkeypatch.setenv(FAKE_ATC_SECONDS_ENV, "1")  # slow: minutes on a board
    monkeypatch.setattr(node_profile, "time", FakeTime(2e-3))
    monkeypatch.setattr(node_profile, "time_one_layer", lambda loaded: 5.0)
    monkeypatch.setattr(node_profile, "time_output_head", lambda loaded: 1.0)
    monkeypatch.setattr(
        node_profile, "profile_device", functools.partial(device_probe.profile_device, sizes=SMALL)
    )
    with fake_cann(tmp_path):
        loaded = load_model(tiny_model_path("tiny-qwen3"), backend="acl", mode="exact", npu_ctx=64)
        assert _atc_runs(log) == 1  # the profile's window, compiled as the backend was made

        def profile(refresh: bool = False) -> node_profile.NodeProfile:
            return node_profile.node_profile(
                loaded, "npu0", "f" * 16, budget_bytes=None, cache_dir=tmp_path / "profiles", refresh=refresh
            )

        accel = profile().device.accelerator
        assert accel is not None  # timed on the compiled window
        assert accel.compiled_windows == ((0, 1),)  # what a plan may give its NPU
        assert _atc_runs(log) == 1
        # The window gone from the acl cache (e.g. a CANN upgrade): the profile reports the node
        # as CPU-only and says how to compile, and still runs no ATC.
        for om in (tmp_path / "cache" / "acl").rglob("window.om"):
            om.unlink()
        with caplog.at_level(logging.WARNING, logger="prima.daemon"):
            assert profile(refresh=True).device.accelerator is None
            assert profile().device.accelerator is None  # the cached CPU profile, not measured again
        assert "not compiled for the accelerator" in caplog.text
        assert "prima npu compile" in caplog.text
        assert _atc_runs(log) == 1
        loaded.model.backend.close()


def test_a_serving_backend_refuses_a_window_not_compiled_without_running_atc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_ahead compiles the windows asked for (a progress line each), then the backend
    loads those and refuses any other at once, naming the command that compiles it."""
    log = tmp_path / "atc.log"
    monkeypatch.setenv(FAKE_ATC_LOG_ENV, str(log))
    with fake_cann(tmp_path):
        loaded = load_model(tiny_model_path("tiny-qwen3"), backend="acl", mode="exact", npu_ctx=64)
        lines: list[str] = []
        assert compile_ahead(loaded, [range(0, 2), range(0, 1), range(0, 2)], lines.append) == []
        assert lines == ["compiling NPU window 1/1: layers 0-1 (ATC)"]  # 0-1 cached at start
        runs = _atc_runs(log)
        backend = loaded.model.backend
        assert backend.ready_windows() == (range(0, 1), range(0, 2))  # reported in its profile
        backend.release_window(backend.load_window(range(0, 2)))
        with pytest.raises(WindowNotCompiledError, match=r"prima npu compile .*--window 1-3 --npu-ctx 64"):
            backend.load_window(range(1, 3))
        assert _atc_runs(log) == runs
        backend.close()


@pytest.mark.slow
def test_a_daemon_compiles_before_it_is_ready_and_never_inside_a_request(tmp_path: Path) -> None:
    """primad --backend acl with a slow stand-in ATC that logs its runs: every run happens before
    the ready line; Profile, LoadPlan and generations run none, and a plan naming an NPU window
    that is not compiled is refused with the command to run, the daemon serving on."""
    log = tmp_path / "atc.log"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**standin_env(tmp_path), FAKE_ATC_LOG_ENV: str(log)}.items():
            mp.setenv(name, value)
        mp.setenv(FAKE_ATC_SECONDS_ENV, "1")  # slow: minutes on a board
        mp.setenv(PROFILE_CACHE_ENV, str(tmp_path / "profiles"))
        daemon = LocalRing.start(
            1,
            tiny_model_path(TAG),
            threads=1,
            log_dir=tmp_path / "logs",
            extra_args=("--exact", "--backend", "acl", "--npu-ctx", "64", "--npu-window", "0-2"),
        )
    try:
        at_ready = _atc_runs(log)
        assert at_ready == 2  # the profile's window (layer 0) and layers 0-1
        ring = Ring.connect(daemon.addresses, window_sizes=[N_LAYERS])
        try:
            node = [(n.node_id, n.address) for n in ring.plan.nodes]
            assert ring.clients[0].profile().device.accelerator is not None
            prompt = load_tiny_oracle(TAG)["prompts"][0]
            expected = prompt["f32"]["greedy_token_ids"][:4]
            plan = plan_from_window_sizes(
                node, [N_LAYERS], 1, N_LAYERS, accel_layers=[2], epoch=ring.plan.epoch + 1
            )
            ring.load_plan(plan)
            assert _tokens(ring, prompt["prompt_token_ids"], len(expected)) == expected
            refused = plan_from_window_sizes(
                node, [N_LAYERS], 1, N_LAYERS, accel_layers=[3], epoch=plan.epoch + 1
            )
            with pytest.raises(
                PrimaError, match=r"layers 0-2 are not compiled.*prima npu compile .*--window 0-3"
            ):
                ring.load_plan(refused)
            again = plan_from_window_sizes(
                node, [N_LAYERS], 1, N_LAYERS, accel_layers=[2], epoch=refused.epoch + 1
            )
            ring.load_plan(again)
            assert _tokens(ring, prompt["prompt_token_ids"], len(expected)) == expected
        finally:
            ring.close()
        assert _atc_runs(log) == at_ready
    finally:
        daemon.close()


def _tokens(ring: Ring, prompt_ids: list[int], n: int) -> list[int]:
    request = GenerateRequest(tuple(prompt_ids), n, SamplerConfig(), (), n_ctx=64)
    return [t for t in ring.generate(request) if isinstance(t, int)]
