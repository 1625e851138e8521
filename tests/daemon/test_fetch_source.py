"""Where a node without the model file fetches its header from, as rules with the clock and the
sources injected: holders in order, a holder failing the TLS check skipped for good, a source
not up yet waited for (with progress lines) until a deadline."""

from __future__ import annotations

import pytest

from prima.daemon.fetch_source import PROGRESS_EVERY_S, fetch_sources, first_source
from prima.errors import NodeError, UntrustedNodeError
from prima.net.node_adverts import NodeAdvert

FP_A, FP_B = "a1" * 32, "b2" * 32


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_holders_are_tried_most_common_model_first() -> None:
    partial = NodeAdvert("partial", "127.0.0.1", 7601, FP_A)
    holders = [
        NodeAdvert("odd", "127.0.0.1", 7602, FP_B, holds_full_file=True),
        NodeAdvert("b", "127.0.0.1", 7603, FP_A, holds_full_file=True),
        NodeAdvert("a", "127.0.0.1", 7604, FP_A, holds_full_file=True),
        NodeAdvert("old", "127.0.0.1", 7605, FP_A, protocol_version=99, holds_full_file=True),
    ]
    assert [a.node_id for a in fetch_sources([partial, *holders])] == ["a", "b", "odd"]
    assert fetch_sources([partial]) == []


def test_a_rogue_holder_is_skipped_and_the_real_one_used() -> None:
    tried: list[str] = []
    lines: list[str] = []

    def attempt(address: str) -> str:
        tried.append(address)
        if address == "rogue:1":
            raise UntrustedNodeError("rogue:1 did not show a node certificate this cluster issued")
        return "store"

    t = FakeTime()
    got = first_source(
        lambda: ["rogue:1", "real:2"],
        attempt,
        wait_s=600,
        progress=lines.append,
        more_may_come=True,
        clock=t.clock,
        sleep=t.sleep,
    )
    assert got == ("store", "real:2")
    assert tried == ["rogue:1", "real:2"]
    assert lines == ["skipping rogue:1: it failed the TLS check, so it is not a member of this cluster"]


def test_a_source_not_up_yet_is_waited_for_with_progress_lines() -> None:
    t = FakeTime()
    lines: list[str] = []
    rounds: list[list[str]] = []

    def candidates() -> list[str]:
        # A rogue is advertised from the start; the real holder is up after 100 s.
        found = ["rogue:1", "real:2"]
        rounds.append(found)
        return found

    def attempt(address: str) -> str:
        if address == "rogue:1":
            raise UntrustedNodeError("not a member")
        if t.now < 100:
            raise NodeError("real:2 did not answer (connection refused)")
        return "store"

    got = first_source(
        candidates,
        attempt,
        wait_s=600,
        progress=lines.append,
        more_may_come=True,
        clock=t.clock,
        sleep=t.sleep,
    )
    assert got == ("store", "real:2")
    assert 100 <= t.now < 110
    assert sum("skipping rogue:1" in m for m in lines) == 1  # refused once, never tried again
    waits = [m for m in lines if m.startswith("waiting for real:2")]
    assert 100 / PROGRESS_EVERY_S - 1 <= len(waits) <= 100 / PROGRESS_EVERY_S + 1
    assert "giving up in" in waits[0]
    assert "--fetch-wait" in waits[0]


def test_the_wait_has_a_deadline() -> None:
    t = FakeTime()

    def attempt(address: str) -> str:
        raise NodeError(f"{address} did not answer (connection refused)")

    with pytest.raises(
        NodeError, match=r"within 30 s \(--fetch-wait\): h:1 did not answer .*--fetch-from HOST:PORT"
    ):
        first_source(
            lambda: ["h:1"],
            attempt,
            wait_s=30,
            progress=lambda _: None,
            more_may_come=True,
            clock=t.clock,
            sleep=t.sleep,
        )
    assert 30 <= t.now < 33
    with pytest.raises(NodeError, match="no primad on this network advertised the whole model file"):
        first_source(
            lambda: [],
            attempt,
            wait_s=30,
            progress=lambda _: None,
            more_may_come=True,
            clock=t.clock,
            sleep=t.sleep,
        )


def test_a_named_source_that_fails_the_tls_check_ends_the_search() -> None:
    def attempt(address: str) -> str:
        raise UntrustedNodeError(f"{address} is not a member")

    with pytest.raises(UntrustedNodeError, match="h:1 is not a member"):
        first_source(lambda: ["h:1"], attempt, wait_s=600, progress=lambda _: None, more_may_come=False)
