"""A daemon's graceful stop (SIGTERM, SIGINT): take no new plan or session, let the sessions
open now finish within a deadline, then end the rest with an error their coordinators can read.

The sessions are the work in flight: on the head one per generation, on a follower one per
generation it has layers of. Each closes when its generation ends (the head closes its own and
tells the followers), so waiting for the count to reach zero waits for those generations.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("prima.daemon")

POLL_S = 0.1  # how often the open sessions are counted while waiting
WIND_UP_S = 5.0  # after cutting: how long the heads' generations get to end and close theirs


class Stoppable(Protocol):
    """What draining needs of the node runtime."""

    node_id: str

    def stop_taking_work(self) -> list[str]: ...

    def session_ids(self) -> list[str]: ...

    def cut_session(self, session_id: str, why: str) -> None: ...


@dataclass(frozen=True)
class DrainReport:
    """How the sessions open when the stop began ended: on their own, or cut at the deadline."""

    in_flight: int
    finished: int
    cut: int


def drain(node: Stoppable, timeout_s: float, now: threading.Event | None = None) -> DrainReport:
    """Refuse new work, wait up to `timeout_s` (or until `now` is set: a second signal) for the
    open sessions to close, then cut the rest."""
    at_start = set(node.stop_taking_work())
    deadline = time.monotonic() + timeout_s
    now = now or threading.Event()
    while node.session_ids() and not now.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        now.wait(min(POLL_S, remaining))
    left = node.session_ids()
    why = (
        f"node {node.node_id} is shutting down: the generation was cut at its {timeout_s:g} s "
        "--shutdown-timeout"
        if not now.is_set()
        else f"node {node.node_id} is shutting down: the generation was cut (stopped again)"
    )
    for session_id in left:
        node.cut_session(session_id, why)
    wind_up = time.monotonic() + WIND_UP_S
    while node.session_ids() and time.monotonic() < wind_up:
        time.sleep(POLL_S)
    cut = len(at_start & set(left))
    return DrainReport(in_flight=len(at_start), finished=len(at_start) - cut, cut=cut)
