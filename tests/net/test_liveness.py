"""Waiting on a ring with probes during silences, on a fake clock: a node that misses probes in a
row is named, one that misses once is not, each probe after a miss waits longer, and a ring that
answers but stays silent gives up."""

from __future__ import annotations

import queue
from collections.abc import Callable

import pytest

from prima.errors import NodeError
from prima.net.liveness import Liveness, NodeGoneError, wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def silent_until(clock: FakeClock, arrives_at: float | None) -> Callable[[float], str]:
    """A get() that waits out its slice on the fake clock, until the item arrives."""

    def get(timeout_s: float) -> str:
        if arrives_at is not None and clock.now + timeout_s >= arrives_at:
            clock.now = arrives_at
            return "item"
        clock.now += timeout_s
        raise queue.Empty

    return get


def scripted_probe(clock: FakeClock, answers: list[list[str]]) -> Callable[[float], list[str]]:
    """Each call returns the next list of silent nodes, taking the probe's deadline if any is silent."""

    def probe(timeout_s: float) -> list[str]:
        silent = answers.pop(0) if answers else []
        if silent:
            clock.now += timeout_s
        return silent

    return probe


def test_a_node_missing_probes_in_a_row_is_named() -> None:
    clock = FakeClock()
    live = Liveness(quiet_s=1.0, probe_timeout_s=1.5, misses=2, give_up_s=300)
    probe = scripted_probe(clock, [["node2 at h:2"], ["node2 at h:2"]])
    with pytest.raises(NodeGoneError, match="node2 at h:2 stopped answering") as err:
        wait_for(silent_until(clock, None), probe, live, what="session s", clock=clock)
    assert err.value.nodes == ("node2 at h:2",)
    assert clock.now == pytest.approx(6.5)  # two silent slices, probes that timed out after 1.5 and 3 s


def test_each_probe_after_a_miss_allows_longer() -> None:
    clock = FakeClock()
    live = Liveness(quiet_s=1.0, probe_timeout_s=1.5, misses=3, give_up_s=300)
    deadlines: list[float] = []
    answers = [["node1 at h:1"], ["node1 at h:1"], [], ["node1 at h:1"], []]

    def probe(timeout_s: float) -> list[str]:
        deadlines.append(timeout_s)
        silent = answers.pop(0)
        if silent:
            clock.now += timeout_s
        return silent

    got = wait_for(silent_until(clock, 11.5), probe, live, what="session s", clock=clock)
    assert got == "item"
    # Two misses double the deadline twice; an answer starts the count again.
    assert deadlines == [1.5, 3.0, 6.0, 1.5, 3.0]


def test_a_single_missed_probe_is_forgiven() -> None:
    clock = FakeClock()
    live = Liveness(quiet_s=1.0, probe_timeout_s=1.5, misses=2, give_up_s=300)
    probe = scripted_probe(clock, [["node1 at h:1"], [], ["node1 at h:1"], []])
    got = wait_for(silent_until(clock, 9.0), probe, live, what="session s", clock=clock)
    assert got == "item"


def test_a_ring_that_answers_but_stays_silent_gives_up() -> None:
    clock = FakeClock()
    live = Liveness(quiet_s=1.0, give_up_s=10.0)
    with pytest.raises(NodeError, match="nothing came within 10 s although every node answers"):
        wait_for(silent_until(clock, None), scripted_probe(clock, []), live, what="session s", clock=clock)


def test_default_liveness_names_a_hung_node_within_five_seconds() -> None:
    clock = FakeClock()
    probe = scripted_probe(clock, [["node2 at h:2"], ["node2 at h:2"]])
    with pytest.raises(NodeGoneError):
        wait_for(silent_until(clock, None), probe, Liveness(), what="session s", clock=clock)
    assert clock.now <= 5.0


def test_quiet_slices_grow_with_the_plans_time_per_token() -> None:
    live = Liveness(quiet_s=1.0)
    assert live.for_token_time(None) == live
    assert live.for_token_time(100.0).quiet_s == 1.0
    assert live.for_token_time(2000.0).quiet_s == pytest.approx(8.0)
