"""What a plan makes each node fetch before it can run, and how long that should take.

A node that holds only some layers of the model (prima.model.sparse) fetches the rest of its
windows from a peer when the plan arrives, and the head also the embedding and output head when
it lacks them. Bytes are counted per layer at the model's largest layer (`layer_bytes`), so the
estimate is an upper bound; time is over the link the node's profile measured. Nodes fetch from
whoever holds the bytes, in the common case all from one holder, so the estimate adds the nodes'
times up (the holder's link is shared) instead of taking the longest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prima.plan import Plan
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile


@dataclass(frozen=True)
class NodeTransfer:
    """The layers node `node_id` lacks for its windows, and its bytes and seconds to fetch."""

    node_id: str
    layers: tuple[int, ...]
    n_bytes: int
    seconds: float


@dataclass(frozen=True)
class TransferEstimate:
    nodes: tuple[NodeTransfer, ...]

    @property
    def n_bytes(self) -> int:
        return sum(n.n_bytes for n in self.nodes)

    @property
    def seconds(self) -> float:
        return sum(n.seconds for n in self.nodes)

    def describe(self) -> str:
        """One line for `prima plan` and the coordinator's log."""
        if not self.n_bytes:
            return "no transfers: every node holds its layers"
        took = f"~{self.seconds:.1f} s" if math.isfinite(self.seconds) else "time unknown (a link unmeasured)"
        parts = ", ".join(
            f"{n.node_id} {len(n.layers)} layer(s) {n.n_bytes / (1 << 20):.0f} MiB"
            for n in self.nodes
            if n.n_bytes
        )
        return f"transfers before the first token: up to {self.n_bytes / (1 << 20):.0f} MiB, {took} ({parts})"


def estimate_transfers(devices: Sequence[DeviceProfile], model: ModelProfile, plan: Plan) -> TransferEstimate:
    """The fetches `plan` needs, given what each of `devices` (by node id) holds."""
    by_id = {d.node_id: d for d in devices}
    nodes = []
    for i, node in enumerate(plan.nodes):
        device = by_id[node.node_id]
        layers = tuple(
            layer for w in node.windows for layer in range(w.start, w.end) if not device.holds_layer(layer)
        )
        n_bytes = len(layers) * model.layer_bytes
        if i == 0 and not device.holds_head_tensors:
            n_bytes += model.input_bytes + model.output_bytes
        bandwidth = device.net_bandwidth_bytes_per_s
        seconds = 0.0
        if n_bytes:
            seconds = n_bytes / bandwidth if bandwidth > 0 else math.inf
        nodes.append(NodeTransfer(node.node_id, layers, n_bytes, seconds))
    return TransferEstimate(tuple(nodes))
