"""Turns at the model go one at a time, in the order they were asked for. Real threads; each
waits until the one before it has asked (its ticket taken), so the order asked is known."""

from __future__ import annotations

import threading
import time

import pytest

from prima.engine.turns import TurnTaking

WAIT_S = 30.0  # a bound for a loaded machine, not an expectation


def _until_asked(turns: TurnTaking, asked: int) -> None:
    """Wait (bounded) until `asked` turns have been asked for."""
    deadline = time.monotonic() + WAIT_S
    while turns._next < asked and time.monotonic() < deadline:
        time.sleep(0.001)
    assert turns._next == asked


def test_turns_go_one_at_a_time_in_the_order_asked() -> None:
    turns = TurnTaking()
    order: list[int] = []
    overlapped: list[int] = []
    inside = threading.Lock()  # held by whoever has the turn

    def take_turn(i: int) -> None:
        with turns.turn():
            if not inside.acquire(blocking=False):
                overlapped.append(i)  # another thread was inside a turn too
                return
            order.append(i)
            inside.release()

    threads = [threading.Thread(target=take_turn, args=(i,), daemon=True) for i in range(6)]
    with turns.turn():
        for i, th in enumerate(threads):
            th.start()
            _until_asked(turns, i + 2)  # this turn, and each thread's so far
        assert order == []  # every thread waits while a turn is held
    for th in threads:
        th.join(WAIT_S)
    assert overlapped == []
    assert order == list(range(6))


def test_a_turn_ends_when_its_holder_raises() -> None:
    turns = TurnTaking()
    with pytest.raises(RuntimeError), turns.turn():
        raise RuntimeError("the pass failed")
    done = threading.Event()

    def take_turn() -> None:
        with turns.turn():
            done.set()

    th = threading.Thread(target=take_turn, daemon=True)
    th.start()
    th.join(WAIT_S)
    assert done.is_set()
