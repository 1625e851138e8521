"""The compute thread's queue takes sessions in turn and keeps each session's order; the worker's
streaming groups keep it too."""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass

import pytest

from prima.daemon.fair_queue import FairQueue
from prima.daemon.worker import _behind_others, _Partial, _same_hop_run


@dataclass(frozen=True)
class Item:
    session_id: str
    n: int
    plan_epoch: int = 1
    hop_index: int = 0


def _drain(q: FairQueue[Item]) -> list[str]:
    out = []
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return out
        out.append(f"{item.session_id}{item.n}")


def test_sessions_take_turns_and_keep_their_order() -> None:
    q: FairQueue[Item] = FairQueue()
    for name, n in [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 1), ("b", 2), ("c", 1)]:
        q.put(Item(name, n))
    assert q.qsize() == 7
    # A burst of four from `a` no longer makes `b` and `c` wait for all of it.
    assert _drain(q) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]


def test_a_session_that_arrives_later_joins_the_turns_at_the_back() -> None:
    q: FairQueue[Item] = FairQueue()
    q.put(Item("flood", 1))
    q.put(Item("flood", 2))
    assert q.get_nowait() == Item("flood", 1)
    q.put(Item("chat", 1))
    q.put(Item("flood", 3))
    assert _drain(q) == ["flood2", "chat1", "flood3"]


def test_get_waits_for_an_item_and_stop_ends_after_the_rest() -> None:
    q: FairQueue[Item] = FairQueue()
    got: list[Item | None] = []
    reader = threading.Thread(target=lambda: got.extend([q.get(), q.get(), q.get()]))
    reader.start()
    q.put(Item("a", 1))
    q.put(Item("a", 2))
    q.stop()
    reader.join(10)
    assert not reader.is_alive()
    assert got == [Item("a", 1), Item("a", 2), None]
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_streaming_groups_take_one_sessions_run_at_a_hop_and_leave_the_rest() -> None:
    act = Item("a", 1)
    pending: collections.deque = collections.deque(
        [Item("b", 1), Item("a", 2), Item("a", 3, hop_index=1), Item("a", 4), Item("c", 1)]
    )
    taken = _same_hop_run(pending, act)  # type: ignore[arg-type]
    # a2 joins a1's group; a4 does not: a3, at another hop, comes before it in a's order.
    assert taken == [Item("a", 2)]
    assert list(pending) == [Item("b", 1), Item("a", 3, hop_index=1), Item("a", 4), Item("c", 1)]


def test_the_rest_of_a_batch_put_back_goes_after_the_other_sessions_but_first_in_its_own() -> None:
    q: FairQueue[Item] = FairQueue()
    for name, n in [("flood", 2), ("chat", 1), ("other", 1)]:
        q.put(Item(name, n))
    assert q.others_waiting("flood")
    assert not FairQueue().others_waiting("flood")
    q.put_first(Item("flood", 1))  # the rest of flood's batch 1, which gave up its turn
    assert _drain(q) == ["chat1", "other1", "flood1", "flood2"]
    q.put(Item("flood", 3))
    assert not q.others_waiting("flood")


def test_the_rest_of_a_long_batch_waits_behind_the_other_sessions_and_ahead_of_its_own() -> None:
    """A streaming node serves its queue through `pending`: a batch that gave way goes after
    every other session's items there, and before its own session's later ones."""
    part = _Partial("a", None, None, 1, iter(()))  # type: ignore[arg-type]
    pending: collections.deque = collections.deque([Item("a", 2), Item("b", 1), Item("a", 3), Item("c", 1)])
    _behind_others(pending, part)
    assert list(pending) == [Item("b", 1), Item("c", 1), part, Item("a", 2), Item("a", 3)]
