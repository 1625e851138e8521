"""A daemon's drain (prima.daemon.drain): sessions that close in time are counted finished, the
rest are cut at the deadline; a refusal while stopping is UNAVAILABLE."""

from __future__ import annotations

import threading

import grpc

from prima.daemon.drain import drain
from prima.net.status import ShuttingDownError, status_for


class FakeNode:
    """Sessions by id; `stop_taking_work` and `cut_session` as NodeRuntime's."""

    node_id = "node1"

    def __init__(self, sessions: list[str]) -> None:
        self.sessions = list(sessions)
        self.stopping = False
        self.cut: list[tuple[str, str]] = []

    def stop_taking_work(self) -> list[str]:
        self.stopping = True
        return list(self.sessions)

    def session_ids(self) -> list[str]:
        return list(self.sessions)

    def cut_session(self, session_id: str, why: str) -> None:
        self.cut.append((session_id, why))
        self.sessions.remove(session_id)


def test_drain_counts_sessions_that_finish_in_time() -> None:
    node = FakeNode(["a"])
    closed = threading.Timer(0.05, node.sessions.clear)
    closed.start()
    report = drain(node, timeout_s=60)
    closed.join()
    assert node.stopping
    assert (report.in_flight, report.finished, report.cut) == (1, 1, 0)
    assert node.cut == []


def test_drain_cuts_what_is_left_at_the_deadline() -> None:
    node = FakeNode(["a", "b"])
    report = drain(node, timeout_s=0)
    assert (report.in_flight, report.finished, report.cut) == (2, 0, 2)
    assert [s for s, _ in node.cut] == ["a", "b"]
    assert all("node1 is shutting down" in why and "--shutdown-timeout" in why for _, why in node.cut)


def test_a_second_signal_cuts_at_once() -> None:
    node = FakeNode(["a"])
    now = threading.Event()
    now.set()
    report = drain(node, timeout_s=3600, now=now)
    assert report.cut == 1
    assert "stopped again" in node.cut[0][1]


def test_refusals_while_stopping_are_unavailable() -> None:
    assert status_for(ShuttingDownError("node1 is shutting down")) == grpc.StatusCode.UNAVAILABLE
