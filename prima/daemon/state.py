"""What a daemon holds between calls: the loaded plan as this node sees it, and its sessions."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from prima.backends.base import KVState
from prima.errors import NodeError
from prima.net.client import NodeClient, RelayStream
from prima.net.codec import Activation, WireDType
from prima.plan import Hop, Plan
from prima.weights.window import LayerWindows


@dataclass(frozen=True)
class Layout:
    """The loaded plan as this node sees it."""

    plan: Plan
    me: int  # this node's index in plan.nodes; 0 is the head
    hops: tuple[Hop, ...]
    windows: LayerWindows
    clients: dict[int, NodeClient]  # the nodes this one sends to (and the head)
    wire_dtype: WireDType
    auto_budget: int | None  # the layer budget measured at plan load (auto), before any KV cache

    @property
    def is_head(self) -> bool:
        return self.me == 0

    def layers(self) -> list[int]:
        return [i for w in self.plan.nodes[self.me].windows for i in range(w.start, w.end)]


@dataclass
class NodeSession:
    """One session on this node: the KV cache of its own layers and its open Relay streams.
    On the head, `results` collects the micro-batches that have come round the whole ring."""

    session_id: str
    epoch: int
    n_ctx: int
    cache: KVState
    relays: dict[int, RelayStream] = field(default_factory=dict)
    results: queue.SimpleQueue[Activation | NodeError] | None = None

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()
