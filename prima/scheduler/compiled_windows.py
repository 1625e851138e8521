"""Plans that give an accelerator only windows it can run now.

An NPU runs a window only once ATC has compiled it (minutes on a board), and a serving daemon
never compiles inside a request: it refuses a plan that names any other window. Halda chooses
windows from speeds and memory alone, so a plan is checked against the windows each node
reports compiled (`AcceleratorProfile.compiled_windows`): a node whose accelerator lacks one of
the plan's windows is planned again on its CPU, and the note says what to compile so that the
next plan can use its accelerator. Without this, the first run of a mixed ring on a fresh board
would fail at LoadPlan."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prima.plan import Plan
from prima.scheduler import halda
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile


def accelerator_windows(plan: Plan, node_id: str) -> list[range]:
    """The layers of each window of `node_id` that `plan` puts on its accelerator (the first
    `accel_layers` of each window that is not empty), in order; none without accelerator layers."""
    for node in plan.nodes:
        if node.node_id == node_id and node.accel_layers:
            return [
                range(w.start, w.start + min(node.accel_layers, w.n_layers))
                for w in node.windows
                if w.n_layers
            ]
    return []


def missing_windows(plan: Plan, devices: Sequence[DeviceProfile]) -> dict[str, list[range]]:
    """node id -> the accelerator windows `plan` gives it that it has not compiled."""
    missing: dict[str, list[range]] = {}
    for device in devices:
        accel = device.accelerator
        if accel is None:
            continue
        lacking = [w for w in accelerator_windows(plan, device.node_id) if not accel.runs(w)]
        if lacking:
            missing[device.node_id] = lacking
    return missing


def solve_on_compiled(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    *,
    max_rounds: int | None = None,
    epoch: int = 1,
) -> tuple[Plan, list[str]]:
    """Halda's plan over `devices`, with every accelerator window in it compiled on its node,
    and a note per node that Halda wanted on an accelerator window it lacks (that node is then
    planned on its CPU). Each round takes one accelerator out, so this ends."""
    devices = list(devices)
    notes: list[str] = []
    while True:
        plan = halda.solve(devices, model, max_rounds=max_rounds, epoch=epoch)
        missing = missing_windows(plan, devices)
        if not missing:
            return plan, notes
        for node_id, windows in missing.items():
            notes.append(compile_note(node_id, windows))
        devices = [dataclasses.replace(d, accelerator=None) if d.node_id in missing else d for d in devices]


def compile_note(node_id: str, windows: Sequence[range]) -> str:
    """What to run on `node_id` so that its accelerator can take `windows` in a later plan."""
    spans = " ".join(f"{w.start}-{w.stop}" for w in windows)
    flags = " ".join(f"--window {w.start}-{w.stop}" for w in windows)
    npu = " ".join(f"--npu-window {w.start}-{w.stop}" for w in windows)
    return (
        f"{node_id}: its NPU has not compiled the layers the plan would give it ({spans}; "
        "[start-end)), so it computes on its CPU in this plan; to use its NPU, run "
        f"`prima npu compile {flags}` there with its primad's --model and --npu-ctx, or restart "
        f"its primad with {npu}, then plan again"
    )
