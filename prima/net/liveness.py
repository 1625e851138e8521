"""Telling a slow ring from a dead one within seconds.

Whoever waits on the ring (the head for activations to come back, the coordinator for the head's
next token) waits in short slices. When a slice passes in silence it asks the nodes it depends on
for their Info with a short deadline: a node that misses `misses` probes in a row is gone (killed,
hung, or cut off), and the wait ends with a NodeError naming it. Each probe after a miss waits
`backoff` times longer, so a node that is only slow to answer (its Python threads waiting on a
long stretch of compute that holds the GIL) gets the time to prove it is alive before a re-plan. Nodes that answer are only slow,
so the wait goes on, up to `give_up_s` (primad --ring-timeout) for a ring that is up but stuck.

A probe costs one small RPC per node and only happens after a silence, so a healthy ring, whose
tokens come every few milliseconds, never sends one.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from prima.errors import NodeError

from .client import NodeClient

log = logging.getLogger("prima.net")

T = TypeVar("T")
Clock = Callable[[], float]


class NodeGoneError(NodeError):
    """One or more nodes stopped answering probes; `nodes` names them ("node2 at host:port")."""

    def __init__(self, message: str, nodes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.nodes = nodes


@dataclass(frozen=True)
class Liveness:
    """How long a wait stays patient. A hung node is named after about
    `misses * quiet_s + probe_timeout_s * (1 + backoff + ... + backoff**(misses - 1))` seconds
    (4.5 s with the defaults, under a 5 s bound with room for the detection's own work)."""

    quiet_s: float = 0.75  # silence before the nodes are probed, and between probes
    probe_timeout_s: float = 1.0  # Info deadline of the first probe
    misses: int = 2  # probes in a row a node may miss before it counts as gone
    give_up_s: float = 300.0  # every node answers, yet nothing comes back for this long
    backoff: float = 2.0  # each probe after a miss allows this many times longer

    def __post_init__(self) -> None:
        if self.quiet_s <= 0 or self.probe_timeout_s <= 0 or self.misses < 1 or self.give_up_s <= 0:
            raise ValueError(f"liveness times must be positive and misses >= 1: {self}")
        if self.backoff < 1:
            raise ValueError(f"liveness backoff must be >= 1: {self}")

    def probe_deadline_s(self, missed: int) -> float:
        """The Info deadline of a probe that follows `missed` misses in a row."""
        return self.probe_timeout_s * self.backoff**missed

    def for_token_time(self, predicted_ms_per_token: float | None) -> Liveness:
        """Slices sized to the plan: a ring predicted to take long per token is not probed
        before a few tokens' worth of silence."""
        if not predicted_ms_per_token:
            return self
        return dataclasses.replace(self, quiet_s=max(self.quiet_s, 4 * predicted_ms_per_token / 1000))


def probe_nodes(clients: Iterable[NodeClient], timeout_s: float) -> list[str]:
    """The nodes among `clients` that do not answer Info within `timeout_s`, by name and address."""
    silent = []
    for client in clients:
        try:
            client.info(timeout_s=timeout_s)
        except NodeError as exc:
            log.info("probe: %s", exc)
            silent.append(f"{client.name} at {client.address}")
    return silent


def wait_for(
    get: Callable[[float], T],
    probe: Callable[[float], list[str]],
    liveness: Liveness,
    *,
    what: str,
    clock: Clock = time.monotonic,
) -> T:
    """What `get(timeout_s)` returns (it raises queue.Empty on a silent slice); between slices,
    `probe(timeout_s)` lists the nodes that do not answer. NodeGoneError names nodes that missed
    `liveness.misses` probes in a row; NodeError after `give_up_s` of silence from a ring that
    answers. `what` says what was awaited, for the messages."""
    start = clock()
    missed: dict[str, int] = {}
    while True:
        left = liveness.give_up_s - (clock() - start)
        if left <= 0:
            raise NodeError(
                f"{what}: nothing came within {liveness.give_up_s:.0f} s although every node answers; "
                "check the nodes' logs"
            )
        try:
            return get(min(liveness.quiet_s, left))
        except queue.Empty:
            pass
        silent = set(probe(liveness.probe_deadline_s(max(missed.values(), default=0))))
        missed = {name: missed.get(name, 0) + 1 for name in silent}
        gone = sorted(name for name, n in missed.items() if n >= liveness.misses)
        if gone:
            waited = clock() - start
            raise NodeGoneError(
                f"{what}: node(s) {', '.join(gone)} stopped answering ({waited:.1f} s without a reply); "
                "restart them or plan without them",
                tuple(gone),
            )
