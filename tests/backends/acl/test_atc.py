"""The ATC command lines the acl backend would run, as `prima npu compile --dry-run` prints them,
checked against the flags CANN documents for an ONNX model on the 310B (prima.backends.acl.atc):
ONNX framework, the SoC, ND format, one shape per graph input and one value per -1 in every
gear, and the precision mode that keeps the graph's fp32 norms."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.model.files import open_model
from tests.conftest import tiny_model_path

pytest.importorskip("onnx")

from prima.backends.acl import atc  # noqa: E402
from prima.backends.acl.onnx_window import window_graph  # noqa: E402

DOCUMENTED = {"--framework", "--model", "--output", "--soc_version", "--input_format", "--input_shape"}
DOCUMENTED |= {"--dynamic_dims", "--precision_mode", "--precision_mode_v2", "--log"}


def _flags(argv: list[str]) -> dict[str, str]:
    assert argv[0].endswith("atc")
    pairs = dict(a.split("=", 1) for a in argv[1:])
    assert set(pairs) <= DOCUMENTED, set(pairs) - DOCUMENTED
    return pairs


def test_dry_run_prints_the_atc_command_of_each_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PRIMA_CACHE", str(tmp_path))
    path = tiny_model_path("tiny-qwen2")
    cfg = open_model(path).config
    windows = [range(0, 1), range(1, cfg.n_layers)]
    argv = ["npu", "compile", "-m", str(path), "--dry-run", "--npu-ctx", "256", "--gears", "1,8"]
    assert main([*argv, *(f"--window={w.start}-{w.stop}" for w in windows)]) == 0
    lines = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if line.startswith("atc")]
    assert len(lines) == len(windows)
    for layers, line in zip(windows, lines, strict=True):
        flags = _flags(line)
        assert flags["--framework"] == "5"  # ONNX
        assert flags["--soc_version"] == "Ascend310B1"
        assert flags["--input_format"] == "ND"  # --dynamic_dims requires it
        assert flags["--precision_mode"] == "must_keep_origin_dtype"
        assert flags["--model"].endswith(".onnx")
        assert Path(flags["--output"] + ".om").parent == Path(flags["--model"]).parent
        graph = window_graph(cfg, layers, 256)
        shapes = dict(part.split(":") for part in flags["--input_shape"].split(";"))
        assert list(shapes) == list(graph.inputs)
        assert shapes[f"past_k_{layers.start}"] == f"256,{cfg.n_kv_heads},{cfg.head_dim}"
        n_free = sum(s.split(",").count("-1") for s in shapes.values())
        gears = [[int(v) for v in g.split(",")] for g in flags["--dynamic_dims"].split(";")]
        assert gears == [[1, 1, 1, 257], [8, 8, 8, 264]]
        assert all(len(g) == n_free for g in gears)
    assert not any(tmp_path.rglob("*.onnx"))  # a dry run writes nothing


def test_sliding_windows_get_their_own_mask_dims() -> None:
    cfg = open_model(tiny_model_path("tiny-qwen2")).config
    assert atc.gear_values(4, 100, sliding=True) == [4, 4, 4, 104, 4, 104]
    shape, dims = atc.shapes(cfg, range(1), 100, (1, 2))
    assert shape.startswith(f"hidden:-1,{cfg.d_model};positions:-1;mask:-1,-1;past_k_0:")
    assert dims == "1,1,1,101;2,2,2,102"
