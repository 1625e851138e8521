"""What a session's results queue on the head takes (prima.daemon.state): what comes back from
the ring and the head's own hops (OwnHop), never more than the head has in flight."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from prima.daemon.state import NodeSession, OwnHop
from prima.errors import ProtocolError
from prima.net.codec import Activation


def _act(hop_index: int) -> Activation:
    return Activation("s", 1, hop_index, np.array([0]), np.zeros((1, 4), np.float32))


def _head_session(in_flight: int) -> NodeSession:
    session = NodeSession("s", 1, 8, cache=None, results=queue.SimpleQueue())  # type: ignore[arg-type]
    session.in_flight = in_flight
    return session


def test_results_and_own_hops_queue_as_themselves() -> None:
    session = _head_session(in_flight=2)
    own = OwnHop(_act(0))
    session.hand_back(own, "a peer")
    session.hand_back(_act(1), "a peer")
    assert session.results is not None
    assert session.results.get_nowait() is own
    assert session.results.get_nowait().hop_index == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("item", [_act(1), OwnHop(_act(0))])
def test_more_than_in_flight_is_refused(item: Activation | OwnHop) -> None:
    session = _head_session(in_flight=0)
    with pytest.raises(ProtocolError, match="did not ask for: it has 0 micro-batch"):
        session.hand_back(item, "a peer")


def test_only_the_head_collects_results() -> None:
    session = NodeSession("s", 1, 8, cache=None)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="only the head collects results"):
        session.hand_back(_act(1), "a peer")
