"""`prima npu doctor` through FakeAcl and the stand-in ATC (no NPU result): it reports the
toolchain, the compiled window's inputs, outputs and gears as the runtime gives them, the
device's memory, and the window's difference from the CPU backend; numpy 2 beside pyACL is
flagged, and a missing ATC stops it with the fix."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from prima.cli.main import main
from tests.conftest import tiny_model_path

pytest.importorskip("onnxruntime")

from tests.backends.acl.fake_acl import fake_cann


def test_the_doctor_reports_what_a_bug_report_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_cann(tmp_path):
        code = main(["npu", "doctor", "-m", str(tiny_model_path("tiny-qwen3")), "--npu-ctx", "64"])
    out = capsys.readouterr().out
    numpy_2 = int(np.__version__.split(".")[0]) >= 2
    assert code == (1 if numpy_2 else 0)
    assert ("FAIL numpy" in out) == numpy_2
    assert "ok   pyACL:" in out
    assert "FakeAcl" in out
    assert "ok   compile: layer 0" in out
    assert re.search(r"ok   outputs: \S+:0:hidden_out, \S+:0:new_k, \S+:0:new_v", out)
    assert "ok   gears: 4" in out
    assert out.count("ok   gear: dimCount 14") == 4
    assert "ok   get_mem_info DDR" in out
    diff = float(re.search(r"largest \|hidden difference\| (\S+)", out)[1])
    assert diff < 0.05


def test_the_doctor_names_a_missing_atc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_cann(tmp_path):
        monkeypatch.setenv("PATH", "/nonexistent")
        assert main(["npu", "doctor", "-m", str(tiny_model_path("tiny-qwen3"))]) == 1
    out = capsys.readouterr().out
    assert "FAIL atc: not on PATH: source /usr/local/Ascend/ascend-toolkit/set_env.sh" in out
    assert "compile" not in out
