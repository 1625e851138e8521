"""A plan gives an NPU only windows it has compiled (prima.scheduler.compiled_windows): a board
whose NPU lacks the window Halda wants for it is planned on its CPU, with a note naming what to
compile, instead of a plan its daemon would refuse at LoadPlan. Synthetic profiles, no NPU."""

from __future__ import annotations

import dataclasses

import pytest

from prima.errors import InputError
from prima.scheduler import halda
from prima.scheduler.compiled_windows import accelerator_windows, missing_windows, solve_on_compiled
from prima.scheduler.profile_schema import AcceleratorProfile, DeviceProfile
from tests.scheduler.conftest import GiB, make_device, make_model

N_LAYERS = 12


def _ring(compiled: tuple[tuple[int, int], ...] | None) -> list[DeviceProfile]:
    """A laptop head and a board whose NPU is ten times its CPU, which Halda gives NPU layers."""
    npu = AcceleratorProfile(
        kind="acl",
        memory_available_bytes=int(8 * GiB),
        flops={"F32": 200e9},
        mem_bandwidth_bytes_per_s=20e9,
        shares_ram=True,
        compiled_windows=compiled,
    )
    return [
        make_device("laptop", ram_gib=8.0, gflops=20.0),
        make_device("board", ram_gib=8.0, gflops=5.0, accel=npu),
    ]


def test_a_plan_needing_an_npu_window_not_compiled_puts_that_node_on_its_cpu() -> None:
    model = make_model(N_LAYERS)
    wanted = halda.solve(_ring(None), model)
    windows = accelerator_windows(wanted, "board")
    assert windows  # Halda wants the board's NPU: the case being tested
    devices = _ring(((0, N_LAYERS),))  # primad's default: the whole model as one window
    assert missing_windows(wanted, devices) == {"board": windows}
    plan, notes = solve_on_compiled(devices, model)
    assert accelerator_windows(plan, "board") == []
    assert missing_windows(plan, devices) == {}
    [note] = notes
    flags = " ".join(f"--window {w.start}-{w.stop}" for w in windows)
    assert note.startswith("board: its NPU has not compiled")
    assert f"prima npu compile {flags}" in note
    # The plan is Halda's for the board without its NPU: its prediction holds for what runs.
    cpu_only = [devices[0], dataclasses.replace(devices[1], accelerator=None)]
    assert plan == halda.solve(cpu_only, model)


def test_a_plan_whose_npu_windows_are_compiled_is_kept() -> None:
    model = make_model(N_LAYERS)
    wanted = halda.solve(_ring(None), model)
    compiled = tuple((w.start, w.stop) for w in accelerator_windows(wanted, "board"))
    plan, notes = solve_on_compiled(_ring(compiled), model)
    assert notes == []
    assert plan == wanted


def test_compiled_windows_travel_in_the_profile_json() -> None:
    board = _ring(((0, 4), (4, 12)))[1]
    assert DeviceProfile.from_dict(board.to_dict()) == board
    assert DeviceProfile.from_dict(_ring(None)[1].to_dict()).accelerator.compiled_windows is None
    raw = board.to_dict()
    raw["accelerator"]["compiled_windows"] = [[4, 2]]
    with pytest.raises(InputError, match="compiled_windows must be a list of"):
        DeviceProfile.from_dict(raw)
