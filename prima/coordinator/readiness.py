"""Waiting for a ring's nodes to take a plan on. A node holding only part of the model fetches
its windows' bytes in the background (prima.daemon.fetching) and says how far in Info; the
coordinator polls until every node runs the plan, showing progress, and names the node and its
reason when a fetch fails or stalls (its source went away and no other has the bytes).

The loop is bounded: a fetch that brings in no byte for `stall_s` is an error, and so is the
whole wait passing `max_wait_s`. Time and sleep are injected so tests need not wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prima.errors import NodeError
from prima.net.client import NodeClient
from prima.net.node_status import FetchProgress, NodeStatus
from prima.plan import Plan

log = logging.getLogger("prima.coordinator")

POLL_S = 0.5
STALL_S = 300.0  # no new byte at any fetching node for this long (or re-hashing held bytes): give up
MAX_WAIT_S = 48 * 3600.0  # a 40 GB model over a slow link still fits


@dataclass(frozen=True)
class RingFetch:
    """The ring's fetches at one poll: per fetching node (id, progress), and their sums."""

    nodes: tuple[tuple[str, FetchProgress], ...]

    @property
    def held_bytes(self) -> int:
        return sum(p.held_bytes for _, p in self.nodes)

    @property
    def needed_bytes(self) -> int:
        return sum(p.needed_bytes for _, p in self.nodes)

    @property
    def eta_s(self) -> float:
        """The slowest node's estimate: the ring is ready when the last node is."""
        return max((p.eta_s for _, p in self.nodes), default=0.0)


def fetching(info: NodeStatus, epoch: int) -> FetchProgress | None:
    """The node's fetch for plan `epoch`, if it is still bringing bytes in for it."""
    f = info.fetch
    return f if f is not None and f.plan_epoch == epoch and not f.done else None


def wait_ready(
    clients: Sequence[NodeClient],
    plan: Plan,
    *,
    on_progress: Callable[[RingFetch], None] | None = None,
    poll_s: float = POLL_S,
    stall_s: float = STALL_S,
    max_wait_s: float = MAX_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once every node (`clients[i]` is `plan.nodes[i]`) runs `plan`; NodeError naming
    the node if its fetch fails, if no fetching node gains a byte for `stall_s`, if a node turns
    to another plan, or after `max_wait_s`."""
    start = clock()
    last_held, last_gain = -1, start
    while True:
        infos = [c.info() for c in clients]
        pending = []
        for c, info in zip(clients, infos, strict=True):
            f = info.fetch
            if f is not None and f.plan_epoch == plan.epoch and f.error:
                raise NodeError(
                    f"node {info.node_id} at {c.address} could not fetch its windows for plan epoch "
                    f"{plan.epoch}: {f.error}"
                )
            if info.plan_epoch != plan.epoch:
                raise NodeError(
                    f"node {info.node_id} at {c.address} runs plan epoch {info.plan_epoch}, not "
                    f"{plan.epoch} as sent; another coordinator may have planned it"
                )
            progress = fetching(info, plan.epoch)
            if progress is not None:
                pending.append((info.node_id, progress))
        if not pending:
            return
        summary = RingFetch(tuple(pending))
        if on_progress is not None:
            on_progress(summary)
        now = clock()
        if summary.held_bytes > last_held:
            last_held, last_gain = summary.held_bytes, now
        elif now - last_gain > stall_s:
            names = ", ".join(f"{n} ({p.source or 'no source'})" for n, p in pending)
            raise NodeError(
                f"the fetch of plan epoch {plan.epoch}'s windows made no progress in {stall_s:.0f} s "
                f"at {names}; is the node holding the model file still up? Start a primad with the "
                "whole file, or pass --fetch-from HOST:PORT of one"
            )
        if now - start > max_wait_s:
            raise NodeError(
                f"nodes {', '.join(n for n, _ in pending)} still fetch their windows after "
                f"{max_wait_s:.0f} s; give them a faster link or fewer layers"
            )
        sleep(poll_s)
