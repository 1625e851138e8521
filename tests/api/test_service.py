"""The engine queue: first come first served, bounded, and a waiter that gives up leaves cleanly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from prima.api.service import EngineQueue, GenerationCancelled, ServerBusyError

JOIN_S = 10.0  # safety bound on every wait; never an expectation about speed


def _never() -> bool:
    return False


def _wait_until(cond: Callable[[], bool]) -> None:
    """Readiness check for another thread's progress, bounded so a bug fails instead of hanging."""
    for _ in range(1000):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition never became true")


def test_queue_hands_the_engine_over_in_arrival_order() -> None:
    q = EngineQueue(poll_s=0.01)
    q.acquire(_never, timeout_s=JOIN_S)
    order: list[str] = []

    def worker(name: str) -> None:
        q.acquire(_never, timeout_s=JOIN_S)
        order.append(name)
        q.release()

    threads = []
    for n, name in enumerate(("a", "b", "c")):
        t = threading.Thread(target=worker, args=(name,))
        t.start()
        threads.append(t)
        _wait_until(lambda n=n: q.waiting == n + 1)
    q.release()
    for t in threads:
        t.join(JOIN_S)
    assert order == ["a", "b", "c"]
    assert not q.busy
    assert q.waiting == 0


def test_full_queue_refuses_at_once() -> None:
    q = EngineQueue(max_waiting=0)
    q.acquire(_never, timeout_s=JOIN_S)
    with pytest.raises(ServerBusyError, match="retry later"):
        q.acquire(_never, timeout_s=JOIN_S)
    q.release()
    assert not q.busy


def test_cancelled_waiter_leaves_the_queue() -> None:
    q = EngineQueue(poll_s=0.01)
    q.acquire(_never, timeout_s=JOIN_S)
    gone = threading.Event()
    errors: list[Exception] = []

    def waiter() -> None:
        try:
            q.acquire(gone.is_set, timeout_s=JOIN_S)
        except GenerationCancelled as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    _wait_until(lambda: q.waiting == 1)
    gone.set()
    t.join(JOIN_S)
    assert len(errors) == 1
    assert q.waiting == 0
    q.release()
    assert not q.busy


def test_waiter_past_its_deadline_gets_busy_error() -> None:
    q = EngineQueue(poll_s=0.01)
    q.acquire(_never, timeout_s=JOIN_S)
    with pytest.raises(ServerBusyError, match="waited"):
        q.acquire(_never, timeout_s=0.0)
    assert q.waiting == 0
    q.release()
