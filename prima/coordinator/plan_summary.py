"""A ring's plan in one line for the terminal: which node computes which layers, Halda's
predicted time per token, and why the daemons it left out are idle.

Pure: the plan, and for a plan Halda made the device profiles and model it planned with, from
which each idle daemon's reason is derived by the scheduler's own rules (halda.drop_cause).
"""

from __future__ import annotations

from collections.abc import Sequence

from prima.plan import Plan, windows_text
from prima.scheduler.cost_model import DeviceCost, member_memory, ring_costs
from prima.scheduler.halda import DropCause, drop_cause
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile

MiB = float(1 << 20)


def describe_plan(
    plan: Plan, devices: Sequence[DeviceProfile] = (), model: ModelProfile | None = None
) -> str:
    """One line: `plan: node1 [0,10), node0 [10,30) (head); Halda predicts 12.0 ms/token; node2
    idle: ...`. `devices` are the profiles Halda planned with (head first, the idle ones too) and
    `model` the model it planned for; without them (a plan by hand) only the windows are told."""
    costs = _costs_by_node(devices, model)
    parts = [", ".join(_node_text(plan, i, costs.get(plan.nodes[i].node_id)) for i in _hop_order(plan))]
    if plan.predicted_ms_per_token is not None:
        parts.append(f"Halda predicts {plan.predicted_ms_per_token:.1f} ms/token")
    elif not devices:
        parts.append("windows by hand, no prediction")
    parts += _idle_texts(plan, costs)
    return "plan: " + "; ".join(parts)


def _costs_by_node(devices: Sequence[DeviceProfile], model: ModelProfile | None) -> dict[str, DeviceCost]:
    if not devices or model is None:
        return {}
    return {d.node_id: c for d, c in zip(devices, ring_costs(devices, model), strict=True)}


def _hop_order(plan: Plan) -> list[int]:
    """The nodes in the order their first windows run (the head's last in each round)."""
    return sorted(range(len(plan.nodes)), key=lambda i: plan.nodes[i].windows[0].start)


def _node_text(plan: Plan, i: int, cost: DeviceCost | None) -> str:
    """`node0 [20,30) (head)`, with the layers a token rereads from disk when it streams."""
    node = plan.nodes[i]
    notes = ["head"] if i == 0 and len(plan.nodes) > 1 else []
    if node.accel_layers:
        notes.append(f"{node.accel_layers} layer(s) a window on its accelerator")
    reread = _reread_layers(plan, i, cost)
    if reread:
        notes.append(f"rereads {reread} layer(s) a token from disk")
    windows = windows_text(node.windows)
    return f"{node.node_id} {windows}" + (f" ({', '.join(notes)})" if notes else "")


def _reread_layers(plan: Plan, i: int, cost: DeviceCost | None) -> int:
    """How many of node i's layers do not fit its memory and are read from disk every token."""
    if cost is None:
        return 0
    node = plan.nodes[i]
    memory = member_memory(cost, plan.rounds, node.n_layers, node.accel_layers)
    return memory.reread_layers if memory is not None else 0


def _idle_texts(plan: Plan, costs: dict[str, DeviceCost]) -> list[str]:
    """`node1, node2 idle: <why>` for each reason the left-out daemons share."""
    by_reason: dict[str, list[str]] = {}
    for d in plan.dropped:
        cost = costs.get(d.node_id)
        why = _why_idle(plan, cost, costs) if cost is not None else d.reason
        by_reason.setdefault(why, []).append(d.node_id)
    return [f"{', '.join(names)} idle: {why}" for why, names in by_reason.items()]


def _why_idle(plan: Plan, cost: DeviceCost, costs: dict[str, DeviceCost]) -> str:
    cause = drop_cause(cost, plan.rounds, plan.n_layers)
    if cause is DropCause.NO_CPU:
        return "no CPU throughput measured for this model (re-run `prima profile` there)"
    if cause is DropCause.UNREACHABLE:
        return "no network bandwidth measured to them"
    if cause is DropCause.NO_ROOM:
        return f"too little memory for one layer with its KV cache ({cost.layer_ram_bytes / MiB:.0f} MiB)"
    if cause is DropCause.DISK_BUDGET:
        return "their --disk-budget leaves no room to fetch the layers a window needs"
    # Halda weighed every subset of the daemons: with them the predicted time was no better.
    members = [n.node_id for n in plan.nodes]
    fits = ""
    if all(_reread_layers(plan, i, costs.get(n.node_id)) == 0 for i, n in enumerate(plan.nodes)):
        where = f"{members[0]}'s memory" if len(members) == 1 else f"the memory of {' and '.join(members)}"
        fits = f"the model fits in {where} and "
    return f"{fits}each extra hop would cost more than it saves"
