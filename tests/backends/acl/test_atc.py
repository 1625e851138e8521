"""The ATC command lines the acl backend would run, as `prima npu compile --dry-run` prints them,
checked against the flags CANN documents for an ONNX model on the 310B (prima.backends.acl.atc):
ONNX framework, the SoC, ND format, one shape per graph input and one value per -1 in every
gear, and the precision mode that keeps the graph's fp32 norms."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.errors import InputError
from prima.model.config import ModelConfig
from prima.model.files import open_model
from tests.conftest import tiny_model_path

pytest.importorskip("onnx")

from prima.backends.acl import atc
from prima.backends.acl.onnx_window import window_graph
from prima.backends.acl.runtime import MAX_DIM_CNT
from tests.backends.acl.fake_acl import FAKE_ATC_LOG_ENV, write_fake_atc

DOCUMENTED = {"--framework", "--model", "--output", "--soc_version", "--input_format", "--input_shape"}
DOCUMENTED |= {"--dynamic_dims", "--precision_mode", "--precision_mode_v2", "--log"}
DOCUMENTED |= {"--host_env_os", "--host_env_cpu"}


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
        # one packed cache input per K and V, whatever the window's length
        assert shapes["past_k"] == f"{len(layers)},256,{cfg.n_kv_heads},{cfg.head_dim}"
        n_free = sum(s.split(",").count("-1") for s in shapes.values())
        gears = [[int(v) for v in g.split(",")] for g in flags["--dynamic_dims"].split(";")]
        assert gears == [[1, 1, 1, 257], [8, 8, 8, 264]]
        assert all(len(g) == n_free for g in gears)
    assert not any(tmp_path.rglob("*.onnx"))  # a dry run writes nothing


def _sliding(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with Gemma 3's pattern: every other layer attends to a window of 4 positions."""
    return dataclasses.replace(cfg, sliding_window=4, swa_pattern=2)


def test_sliding_windows_stack_their_masks_within_four_dynamic_dims() -> None:
    """ATC takes at most 4 dynamic dims per gear: a window with sliding layers takes its two
    masks as one input (2, n, ctx + n), so it has n, n, n and ctx + n as every other window."""
    cfg = _sliding(open_model(tiny_model_path("tiny-qwen2")).config)
    assert window_graph(cfg, range(2), 100).sliding
    shape, dims = atc.shapes(cfg, range(2), 100, (1, 2))
    assert shape.startswith(f"hidden:-1,{cfg.d_model};positions:-1;mask:2,-1,-1;past_k:2,100,")
    assert dims == "1,1,1,101;2,2,2,102"


def test_a_whole_model_window_fits_the_runtimes_128_dims() -> None:
    """pyACL takes a gear as the full shape of every input, at most 128 dims: with the cache
    packed per window that is 14 dims for any number of layers (one input per layer's K and V
    stopped a window at 20 layers)."""
    cfg = dataclasses.replace(open_model(tiny_model_path("tiny-qwen2")).config, n_layers=30)
    graph = window_graph(cfg, range(30), 512)
    dims = atc.full_dims(graph, graph.inputs, 8)
    assert len(dims) == 14 <= MAX_DIM_CNT
    assert dims[:6] == [8, cfg.d_model, 8, 1, 8, 520]  # hidden, positions, mask
    assert dims[6:10] == [30, 512, cfg.n_kv_heads, cfg.head_dim]  # past_k (past_v the same)


@pytest.mark.parametrize("gears", [(1,), tuple(range(1, 102))])
def test_gear_counts_atc_refuses_are_refused_before_it_runs(gears: tuple[int, ...]) -> None:
    cfg = open_model(tiny_model_path("tiny-qwen2")).config
    with pytest.raises(InputError, match="2 to 100 distinct gears"):
        atc.shapes(cfg, range(1), 64, gears)


@pytest.mark.parametrize(
    ("input_shape", "dynamic_dims", "message"),
    [
        ("x:-1,-1,-1,-1,-1", "1,1,1,1,1;2,2,2,2,2", "at most 4 dynamic dims per gear"),
        ("x:-1,4", "1", "2 to 100 gears"),
        ("x:-1,4", "1,2;3,4", "one value per -1"),
    ],
)
def test_the_stand_in_atc_keeps_atcs_rules(
    tmp_path: Path, input_shape: str, dynamic_dims: str, message: str
) -> None:
    """The stand-in ATC refuses what ATC documents it refuses (docs/backends.md), so a command
    line that breaks a rule fails the tests that compile windows."""
    atc_path = write_fake_atc(tmp_path / "bin") / "atc"
    argv = [str(atc_path), "--framework=5", f"--model={tmp_path / 'm.onnx'}", f"--output={tmp_path / 'm'}"]
    argv += ["--soc_version=Ascend310B1", "--input_format=ND", f"--input_shape={input_shape}"]
    proc = subprocess.run(
        [*argv, f"--dynamic_dims={dynamic_dims}"], capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "m.om").exists()


def test_a_model_compiled_for_another_host_is_found_under_the_name_atc_gives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --host_env_os/--host_env_cpu ATC names the model `<output>_<os>_<cpu>.om`; prima
    caches it as window.om, under a key for that host (a board finds what a laptop compiled)."""
    monkeypatch.setenv("PATH", f"{write_fake_atc(tmp_path / 'bin')}:{os.environ['PATH']}")
    weights = open_model(tiny_model_path("tiny-qwen2")).weights
    board = atc.HostEnv("linux", "aarch64")
    art = atc.artifacts(weights, "f" * 16, range(1), 64, root=tmp_path / "acl", host_env=board)
    flags = _flags(art.job.argv())
    assert (flags["--host_env_os"], flags["--host_env_cpu"]) == ("linux", "aarch64")
    assert atc.compile_window(weights, art, range(1), 64) == art.om
    assert art.om.is_file()
    assert not list(art.directory.glob("window_*.om"))
    here = atc.artifacts(weights, "f" * 16, range(1), 64, root=tmp_path / "acl")
    assert "--host_env_os" not in " ".join(here.job.argv())
    assert (here.directory == art.directory) == (atc.HostEnv.this_machine() == board)


def test_atc_runs_one_compiler_on_one_core_on_a_small_board_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Huawei's board samples' advice below 8 GB (TE_PARALLEL_COMPILER=1,
    MAX_COMPILE_CORE_NUMBER=1) is the default below SMALL_BOARD_RAM_BYTES; the user's values win."""
    small, big = atc.SMALL_BOARD_RAM_BYTES - 1, atc.SMALL_BOARD_RAM_BYTES
    assert atc.atc_environment({"PATH": "/x"}, small) == {
        "PATH": "/x",
        "TE_PARALLEL_COMPILER": "1",
        "MAX_COMPILE_CORE_NUMBER": "1",
    }
    assert atc.atc_environment({"TE_PARALLEL_COMPILER": "2"}, small)["TE_PARALLEL_COMPILER"] == "2"
    assert atc.atc_environment({"PATH": "/x"}, big) == {"PATH": "/x"}
    # and the ATC child sees them (the stand-in logs what it was given)
    log = tmp_path / "atc.log"
    monkeypatch.setenv("PATH", f"{write_fake_atc(tmp_path / 'bin')}:{os.environ['PATH']}")
    monkeypatch.setenv(FAKE_ATC_LOG_ENV, str(log))
    monkeypatch.setenv("TE_PARALLEL_COMPILER", "2")
    monkeypatch.delenv("MAX_COMPILE_CORE_NUMBER", raising=False)
    monkeypatch.setattr(atc, "SMALL_BOARD_RAM_BYTES", 1 << 62)  # this machine counts as small
    weights = open_model(tiny_model_path("tiny-qwen2")).weights
    art = atc.artifacts(weights, "f" * 16, range(1), 64, root=tmp_path / "acl")
    atc.compile_window(weights, art, range(1), 64)
    assert (
        log.read_text(encoding="utf-8").split("\t")[1].strip()
        == "TE_PARALLEL_COMPILER=2,MAX_COMPILE_CORE_NUMBER=1"
    )
