"""A plan: which layers each node of the ring computes, in which rounds, in which order.

Pure data shared by the scheduler (which makes plans), the coordinator and every daemon (which
all derive the same hop order from it). Layer ranges are half-open windows `[start, end)`.

Order (as in the reference technique): node 0 is the head. It embeds the tokens, then within each
round the windows go node 1, node 2, ..., node M-1, node 0; so the head computes the last window
of the last round and applies the output head without another hop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prima.errors import PlanError


@dataclass(frozen=True)
class Window:
    """Layers `[start, end)` computed by one node in one round."""

    start: int
    end: int

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start},{self.end})"


def windows_text(windows: Sequence[Window]) -> str:
    """`[0,3) [9,12)`: the windows that hold layers (a node with fewer layers than rounds sits
    some rounds out), or `-` for none."""
    return " ".join(str(w) for w in windows if w.n_layers) or "-"


@dataclass(frozen=True)
class NodeAssignment:
    """One ring member: its identity, where to reach it, its windows (one per round, in round
    order) and how many of its layers per window run on an accelerator."""

    node_id: str
    address: str
    windows: tuple[Window, ...]
    accel_layers: int = 0

    @property
    def n_layers(self) -> int:
        return sum(w.n_layers for w in self.windows)

    @property
    def window_size(self) -> int:
        """The largest of its windows (they differ by at most a layer between rounds)."""
        return max((w.n_layers for w in self.windows), default=0)


@dataclass(frozen=True)
class Hop:
    """One step of a forward pass: node `node_index` computes `window` in round `round_index`."""

    node_index: int
    round_index: int
    window: Window


@dataclass(frozen=True)
class DroppedDevice:
    node_id: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """Layer-to-device assignment for one model over a ring of nodes (node 0 is the head)."""

    n_layers: int
    rounds: int
    nodes: tuple[NodeAssignment, ...]
    epoch: int = 1
    predicted_ms_per_token: float | None = None
    dropped: tuple[DroppedDevice, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head(self) -> NodeAssignment:
        return self.nodes[0]

    def hops(self) -> list[Hop]:
        """Every window of a forward pass in execution order."""
        order = list(range(1, len(self.nodes))) + [0]
        hops = []
        for r in range(self.rounds):
            for i in order:
                w = self.nodes[i].windows[r]
                if w.n_layers:
                    hops.append(Hop(i, r, w))
        return hops

    def validate(self) -> None:
        """Raise PlanError unless the windows tile `[0, n_layers)` exactly in hop order."""
        if not self.nodes:
            raise PlanError("a plan needs at least one node; start primad on a device")
        if self.rounds < 1:
            raise PlanError(f"rounds must be >= 1, got {self.rounds}")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise PlanError(f"duplicate node ids in plan: {ids}")
        for n in self.nodes:
            if len(n.windows) != self.rounds:
                raise PlanError(
                    f"node {n.node_id} has {len(n.windows)} windows but the plan has {self.rounds} rounds"
                )
        expected = 0
        for hop in self.hops():
            if hop.window.start != expected:
                raise PlanError(
                    f"layers [{expected},{hop.window.start}) are not assigned to any node; "
                    "each round's windows must follow each other"
                )
            expected = hop.window.end
        if expected != self.n_layers:
            raise PlanError(
                f"layers [{expected},{self.n_layers}) are unassigned; windows cover {expected} of {self.n_layers}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (for `--json` output and files); `from_dict` reverses it."""
        return {
            "n_layers": self.n_layers,
            "rounds": self.rounds,
            "epoch": self.epoch,
            "predicted_ms_per_token": self.predicted_ms_per_token,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "address": n.address,
                    "windows": [[w.start, w.end] for w in n.windows],
                    "accel_layers": n.accel_layers,
                }
                for n in self.nodes
            ],
            "dropped": [{"node_id": d.node_id, "reason": d.reason} for d in self.dropped],
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Plan:
        try:
            nodes = tuple(
                NodeAssignment(
                    str(n["node_id"]),
                    str(n["address"]),
                    tuple(Window(int(a), int(b)) for a, b in n["windows"]),
                    int(n.get("accel_layers", 0)),
                )
                for n in raw["nodes"]
            )
            return cls(
                int(raw["n_layers"]),
                int(raw["rounds"]),
                nodes,
                int(raw.get("epoch", 1)),
                raw.get("predicted_ms_per_token"),
                tuple(DroppedDevice(str(d["node_id"]), str(d["reason"])) for d in raw.get("dropped", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"not a plan: {exc!r} is missing or malformed") from exc

    def describe(self) -> str:
        lines = [
            f"plan epoch {self.epoch}: {self.n_layers} layers, {len(self.nodes)} nodes, {self.rounds} round(s)"
        ]
        for i, n in enumerate(self.nodes):
            role = "head" if i == 0 else f"node {i}"
            wins = windows_text(n.windows)
            accel = f", {n.accel_layers} accel layers/window" if n.accel_layers else ""
            lines.append(f"  {role:7} {n.node_id} @ {n.address}: {n.n_layers} layers {wins}{accel}")
        if self.predicted_ms_per_token is not None:
            lines.append(f"  predicted {self.predicted_ms_per_token:.2f} ms/token")
        for d in self.dropped:
            lines.append(f"  dropped {d.node_id}: {d.reason}")
        return "\n".join(lines)


def plan_from_window_sizes(
    nodes: Sequence[tuple[str, str]],
    window_sizes: Sequence[int],
    rounds: int,
    n_layers: int,
    *,
    accel_layers: Sequence[int] | None = None,
    epoch: int = 1,
    predicted_ms_per_token: float | None = None,
    dropped: Sequence[DroppedDevice] = (),
) -> Plan:
    """Build a plan from `w_m` (layers per window of node m, ring order, node 0 the head) and
    the number of rounds k; requires `k * sum(w) == n_layers`."""
    if len(nodes) != len(window_sizes):
        raise PlanError(f"{len(nodes)} nodes but {len(window_sizes)} window sizes")
    if any(w < 0 for w in window_sizes):
        raise PlanError(f"window sizes must be >= 0, got {list(window_sizes)}")
    per_round = sum(window_sizes)
    if per_round * rounds != n_layers:
        raise PlanError(
            f"windows {list(window_sizes)} x {rounds} round(s) cover {per_round * rounds} layers "
            f"but the model has {n_layers}; make the window sizes sum to {n_layers}/rounds"
        )
    return plan_from_layer_counts(
        nodes,
        [rounds * w for w in window_sizes],
        rounds,
        n_layers,
        accel_layers=accel_layers,
        epoch=epoch,
        predicted_ms_per_token=predicted_ms_per_token,
        dropped=dropped,
    )


def split_layers(n_layers: int, rounds: int) -> list[int]:
    """One node's `n_layers` a token as window sizes, one per round: as equal as they can be,
    the larger ones in the last rounds (so a node with any layers has a window in the last
    round, and the head computes the last layers of the model)."""
    base, extra = divmod(n_layers, rounds)
    return [base + (1 if r >= rounds - extra else 0) for r in range(rounds)]


def layer_windows(layer_counts: Sequence[int], rounds: int) -> list[list[Window]]:
    """Each node's windows (ring order, node 0 the head) when node m computes layer_counts[m]
    layers a token over `rounds` rounds (`split_layers`), laid out in hop order."""
    sizes = [split_layers(n, rounds) for n in layer_counts]
    order = list(range(1, len(layer_counts))) + [0]
    windows: list[list[Window]] = [[] for _ in layer_counts]
    cursor = 0
    for r in range(rounds):
        for i in order:
            windows[i].append(Window(cursor, cursor + sizes[i][r]))
            cursor += sizes[i][r]
    return windows


def plan_from_layer_counts(
    nodes: Sequence[tuple[str, str]],
    layer_counts: Sequence[int],
    rounds: int,
    n_layers: int,
    *,
    accel_layers: Sequence[int] | None = None,
    epoch: int = 1,
    predicted_ms_per_token: float | None = None,
    dropped: Sequence[DroppedDevice] = (),
) -> Plan:
    """Build a plan from the layers each node computes a token (ring order, node 0 the head)
    over k = `rounds` rounds: windows of one node differ by at most a layer between rounds, so
    a node's share need not be a multiple of k. Requires `sum(layer_counts) == n_layers`."""
    if len(nodes) != len(layer_counts):
        raise PlanError(f"{len(nodes)} nodes but {len(layer_counts)} layer counts")
    if any(n < 0 for n in layer_counts):
        raise PlanError(f"layer counts must be >= 0, got {list(layer_counts)}")
    if rounds < 1:
        raise PlanError(f"rounds must be >= 1, got {rounds}")
    if sum(layer_counts) != n_layers:
        raise PlanError(
            f"layer counts {list(layer_counts)} cover {sum(layer_counts)} layers but the model has {n_layers}"
        )
    windows = layer_windows(layer_counts, rounds)
    accel = list(accel_layers) if accel_layers is not None else [0] * len(nodes)
    assignments = tuple(
        NodeAssignment(node_id, address, tuple(windows[i]), accel[i])
        for i, (node_id, address) in enumerate(nodes)
    )
    return Plan(n_layers, rounds, assignments, epoch, predicted_ms_per_token, tuple(dropped))


def even_window_sizes(n_nodes: int, n_layers: int, rounds: int = 1) -> list[int]:
    """Split `n_layers / rounds` layers per round as evenly as possible (extra layers go to the
    nodes after the head, which has the embedding and output head to run as well)."""
    if n_layers % rounds:
        raise PlanError(f"{rounds} rounds do not divide {n_layers} layers; pick a divisor of {n_layers}")
    per_round = n_layers // rounds
    if n_nodes > per_round:
        raise PlanError(f"{n_nodes} nodes but only {per_round} layers per round; use fewer nodes or rounds")
    base, extra = divmod(per_round, n_nodes)
    sizes = [base] * n_nodes
    for i in range(extra):
        sizes[(i + 1) % n_nodes] += 1
    return sizes
