"""ATC takes minutes on a board and a coordinator's calls have deadlines, so no request runs it:
the acl backend compiles the profile's window when it is made (a daemon makes it before it
serves), and the profile (what the Profile RPC computes) only loads compiled windows. The
stand-in ATC here is slow and logs every run, so a run inside the profile would show (through
FakeAcl: no NPU result)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest

from prima.daemon import profile as node_profile
from prima.forward.loader import load_model
from prima.scheduler import profiler
from tests.conftest import tiny_model_path
from tests.fake_time import FakeTime

pytest.importorskip("onnxruntime")

from tests.backends.acl.fake_acl import FAKE_ATC_LOG_ENV, FAKE_ATC_SECONDS_ENV, fake_cann

SMALL = profiler.ProbeSizes(mem_bytes=1 << 20, disk_bytes=1 << 20, gemv_rows=64, gemv_cols=64, repeats=2)


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
        node_profile, "profile_device", functools.partial(profiler.profile_device, sizes=SMALL)
    )
    with fake_cann(tmp_path):
        loaded = load_model(tiny_model_path("tiny-qwen3"), backend="acl", mode="exact", npu_ctx=64)
        assert _atc_runs(log) == 1  # the profile's window, compiled as the backend was made

        def profile(refresh: bool = False) -> node_profile.NodeProfile:
            return node_profile.node_profile(
                loaded, "npu0", "f" * 16, budget_bytes=None, cache_dir=tmp_path / "profiles", refresh=refresh
            )

        assert profile().device.accelerator is not None  # timed on the compiled window
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
