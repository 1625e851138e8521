"""What a daemon holds between calls: the loaded plan as this node sees it, and its sessions."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from prima.backends.base import KVState
from prima.errors import NodeError, ProtocolError
from prima.forward.placement import Piece, host_layers, split_window
from prima.net.client import NodeClient, Relay
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

    @property
    def accel_layers(self) -> int:
        """Layers of each of this node's windows that run on its accelerator (the first ones)."""
        return self.plan.nodes[self.me].accel_layers

    def host_layers(self) -> list[int]:
        """This node's layers that its host CPU computes, in compute order."""
        return [
            i
            for w in self.plan.nodes[self.me].windows
            for i in host_layers(range(w.start, w.end), self.accel_layers)
        ]

    def pieces(self, window: range, *, per_layer: bool) -> tuple[Piece, ...]:
        """How one of this node's windows runs: see prima.forward.placement."""
        return split_window(window, self.accel_layers, per_layer=per_layer)

    def close(self) -> None:
        """Stop its layer windows and close its channels to peers (a newer plan replaced it)."""
        self.windows.close()
        for c in self.clients.values():
            c.close()


@dataclass(frozen=True)
class OwnHop:
    """A decode step that reached one of the head's own hops, handed to the head's generation
    thread (Head.receive), which waits for the step anyway and computes it: one thread woken
    per step on the head, not the link's reader and then that one."""

    act: Activation


@dataclass
class NodeSession:
    """One session on this node: the KV cache of its own layers and its open relays to other nodes.
    On the head, `results` collects the micro-batches that have come round the whole ring, and
    those of decode steps at its own hops (OwnHop)."""

    session_id: str
    epoch: int
    n_ctx: int
    cache: KVState
    relays: dict[int, Relay] = field(default_factory=dict)
    results: queue.SimpleQueue[Activation | OwnHop | NodeError] | None = None
    # On the head: micro-batches injected into the ring and not yet back. Each is in `results`
    # at most once at a time (as an OwnHop, or at its end), which bounds what peers may queue.
    in_flight: int = 0
    aborted: bool = False  # a peer's Abort is queued once; more say nothing new

    def hand_back(self, item: Activation | OwnHop, sender: str) -> None:
        """Queue a micro-batch of this session for the head's generation: back from the ring, or
        at one of the head's own hops. ProtocolError if that would put more in `results` than
        the head has in flight: only a broken or hostile peer (`sender`) sends results nobody
        asked for, and they must not grow the head's memory."""
        act = item.act if isinstance(item, OwnHop) else item
        if self.results is None:
            raise ProtocolError(
                f"session {self.session_id} was not started on this node; only the head collects results"
            )
        if self.results.qsize() >= self.in_flight:
            raise ProtocolError(
                f"{sender} sent an activation of session {self.session_id} (hop {act.hop_index}) that the "
                f"head did not ask for: it has {self.in_flight} micro-batch(es) in flight, all accounted for"
            )
        self.results.put(item)

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()
