"""The head of a ring (prima.daemon.head) on a one-node plan: a generation round the ring gives
the tokens of one pass over the whole model; the head's own hops, handed to it as OwnHops, are
computed by the thread that waits for them; a failure in the results ends the wait; requests it
cannot serve are refused before any ring session opens."""

from __future__ import annotations

import numpy as np
import pytest

from prima.daemon.head import RingEngine
from prima.daemon.runtime import NodeRuntime
from prima.daemon.state import OwnHop
from prima.engine.generate import GenerateRequest, GenerationDone
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.errors import InputError, NodeError
from prima.net.codec import WireDType
from prima.net.status import NotReadyError
from tests.daemon.conftest import embedded, pair_plan

PROMPT = [5, 6, 7, 8, 9]


def test_a_ring_of_one_gives_the_logits_of_one_pass(solo_runtime: NodeRuntime) -> None:
    model = solo_runtime.model
    ring = RingEngine(model, solo_runtime.head, n_ctx=32, ubatch=2)  # three micro-batches, pipelined
    try:
        assert not ring.checks_over_network  # its checks of drafts run here: no drafting ahead
        got = ring.forward(PROMPT)
        step = ring.forward([10])  # a decode step: the head's own hop, computed inline
    finally:
        ring.close()
    local = LocalEngine(model, n_ctx=32, ubatch=2)
    np.testing.assert_array_equal(got, local.forward(PROMPT))
    np.testing.assert_array_equal(step, local.forward([10]))
    assert solo_runtime.session_ids() == []  # closed with the engine


def test_generate_samples_greedy_tokens_and_ends(solo_runtime: NodeRuntime) -> None:
    request = GenerateRequest(tuple(PROMPT), 4, SamplerConfig(temperature=0.0), n_ctx=32)
    events = list(solo_runtime.generate(request))
    assert isinstance(events[-1], GenerationDone)
    tokens = events[:-1]
    local = LocalEngine(solo_runtime.model, n_ctx=32)
    expected = [int(np.argmax(local.forward(PROMPT)))]
    while len(expected) < len(tokens):
        expected.append(int(np.argmax(local.forward([expected[-1]]))))
    assert tokens == expected
    assert solo_runtime.session_ids() == []


def test_an_own_hop_is_computed_by_the_receiving_thread(solo_runtime: NodeRuntime) -> None:
    head = solo_runtime.head
    head.open_ring_session("s", 16)
    try:
        session = solo_runtime.need_session("s")
        assert session.results is not None
        session.in_flight = 1
        act = embedded(solo_runtime, "s", [5])
        session.results.put(OwnHop(act))
        back = head.receive("s")
        assert back.hop_index == len(solo_runtime.need_layout().hops)
        assert session.in_flight == 0
        want = LocalEngine(solo_runtime.model, n_ctx=16)
        np.testing.assert_array_equal(
            solo_runtime.model.output_logits(back.hidden[-1:])[0], want.forward([5])
        )
    finally:
        head.close_ring_session("s")


def test_a_failure_in_the_results_ends_the_wait(solo_runtime: NodeRuntime) -> None:
    head = solo_runtime.head
    head.open_ring_session("s", 16)
    try:
        results = solo_runtime.need_session("s").results
        assert results is not None
        results.put(NodeError("node peer: gone"))
        with pytest.raises(NodeError, match="node peer: gone"):
            head.receive("s")
    finally:
        head.close_ring_session("s")


def test_a_model_draft_needs_the_heads_draft_model(solo_runtime: NodeRuntime) -> None:
    request = GenerateRequest(tuple(PROMPT), 2, n_ctx=32, draft=DraftConfig("model"))
    with pytest.raises(InputError, match="node solo .the ring's head. has no draft model"):
        next(iter(solo_runtime.generate(request)))
    assert solo_runtime.session_ids() == []


def test_only_the_head_opens_ring_sessions(solo_runtime: NodeRuntime) -> None:
    solo_runtime.load_plan(pair_plan(epoch=2), "solo", WireDType.F32)  # now the follower
    with pytest.raises(NotReadyError, match="is not the head of the plan; send this to 127.0.0.1:1"):
        solo_runtime.head.open_ring_session("s", 16)
