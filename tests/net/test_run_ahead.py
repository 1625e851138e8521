"""RunAhead runs a generator in its own thread: items in order, the source's error in turn, the
end reported only after on_end, and stop closing the source at its next item."""

from __future__ import annotations

import threading
from collections.abc import Generator

import pytest

from prima.net.run_ahead import WAITING, RunAhead, waiting


def test_items_arrive_in_order_and_the_source_runs_ahead_of_the_consumer() -> None:
    finished = threading.Event()

    def source() -> Generator[int, None, None]:
        yield from range(5)
        finished.set()

    ahead = RunAhead(source())
    # Nobody has asked for an item yet, and the source has still run to its end.
    assert finished.wait(10)
    assert [ahead.next(10) for _ in range(6)] == [0, 1, 2, 3, 4, None]
    assert ahead.next(10) is None  # and stays ended
    assert ahead.join(10)


def test_the_sources_error_is_raised_after_the_items_before_it() -> None:
    def source() -> Generator[int, None, None]:
        yield 1
        raise ValueError("node 2 vanished")

    ahead = RunAhead(source())
    assert ahead.next(10) == 1
    with pytest.raises(ValueError, match="node 2 vanished"):
        ahead.next(10)
    assert ahead.next(10) is None


def test_on_end_has_run_when_the_end_is_reported() -> None:
    ended = threading.Event()
    ahead = RunAhead((i for i in range(2)), on_end=ended.set)
    assert ahead.next(10) == 0
    assert ahead.next(10) == 1
    assert ahead.next(10) is None
    assert ended.is_set()


def test_next_says_waiting_while_the_source_has_nothing_yet() -> None:
    release = threading.Event()

    def source() -> Generator[str, None, None]:
        release.wait(10)
        yield "token"

    ahead = RunAhead(source())
    assert ahead.next(0.05) is WAITING
    release.set()
    assert ahead.next(10) == "token"


def test_stop_closes_the_source_at_its_next_item_and_runs_on_end() -> None:
    step = threading.Event()
    closed = threading.Event()
    ended = threading.Event()

    def source() -> Generator[int, None, None]:
        try:
            for i in range(1000):
                step.wait(10)
                step.clear()
                yield i
                waiting()
        finally:
            closed.set()

    ahead = RunAhead(source(), on_end=ended.set)
    step.set()
    assert ahead.next(10) == 0
    ahead.stop()
    step.set()  # the source makes its next item, which is where it is stopped
    assert closed.wait(10)
    assert ended.wait(10)
    assert ahead.join(10)


def test_an_item_is_handed_over_when_the_source_waits_or_makes_the_next() -> None:
    go_on = threading.Event()

    def source() -> Generator[int, None, None]:
        yield 0
        waiting()  # about to wait: 0 is handed over now
        go_on.wait(10)
        yield 1
        go_on.clear()
        go_on.wait(10)  # no waiting() call: 1 waits for the next item
        yield 2

    ahead = RunAhead(source())
    assert ahead.next(10) == 0
    assert ahead.next(0.2) is WAITING
    go_on.set()
    # 1 is held while the source works on, unannounced, towards 2.
    assert ahead.next(0.2) is WAITING
    go_on.set()
    assert [ahead.next(10), ahead.next(10), ahead.next(10)] == [1, 2, None]
