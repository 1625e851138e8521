"""A ring head keeps sessions open between requests (primad --keep-sessions), on a one-node
plan of tiny-qwen2 in exact mode: the next turn sends only its new tokens round the ring and
still gets llama.cpp's logits and one pass's tokens; kept sessions are bounded, close when idle,
when the node stops taking work and under a new plan; and a kept session the node lost falls
back to the whole prompt on a new session, unseen but in `cached_tokens`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from prima.daemon.kept_sessions import KeptSessions
from prima.daemon.runtime import NodeRuntime
from prima.engine.generate import GenerateRequest, GenerationDone, LocalGenerator, TokenEvent
from prima.engine.local import LocalEngine
from prima.forward.loader import LoadedModel
from prima.net.codec import WireDType
from prima.net.limits import DaemonLimits
from tests.conftest import load_tiny_oracle
from tests.daemon.conftest import solo_plan
from tests.fake_time import FakeTime

N_CTX = 64
IDLE_S = 60.0
F32_TOLERANCE = 1e-3  # tests/engine/test_local.py's, for exact mode against llama.cpp's f32 run


@pytest.fixture
def clock() -> FakeTime:
    return FakeTime()  # moves only when a test advances it


@pytest.fixture
def runtime(tiny_daemon_model: LoadedModel, clock: FakeTime) -> Iterator[NodeRuntime]:
    """The solo head, keeping up to two sessions, its idle time read from `clock`."""
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=0, threads=1, keep_sessions=2)
    runtime.head.kept = KeptSessions(2, lambda e: e.close(), IDLE_S, clock.perf_counter)
    runtime.load_plan(solo_plan(), "solo", WireDType.F32)
    yield runtime
    runtime.shutdown()


@pytest.fixture(scope="module")
def chat() -> dict[str, Any]:
    """tiny-qwen2's 49-token chat prompt with llama.cpp's logits of its last token."""
    return next(p for p in load_tiny_oracle("tiny-qwen2")["prompts"] if p["name"] == "chat_zh")


def _run(
    generator: Any, prompt: list[int], max_tokens: int = 3, *, keep: bool = True
) -> tuple[list[int], GenerationDone]:
    """A request that asks for its session to be kept (as prima chat's turns do), or not."""
    request = GenerateRequest(
        tuple(prompt), max_tokens, n_ctx=N_CTX, want_prompt_logits=True, keep_session=keep
    )
    events: list[TokenEvent] = list(generator.generate(request))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    return [int(e) for e in events[:-1]], done


def _fresh(runtime: NodeRuntime, prompt: list[int], max_tokens: int = 3) -> list[int]:
    """The tokens of one pass over the whole model from an empty cache."""
    return _run(LocalGenerator(LocalEngine(runtime.model, N_CTX)), prompt, max_tokens)[0]


def test_the_next_turn_sends_only_its_new_tokens(runtime: NodeRuntime, chat: dict[str, Any]) -> None:
    ids = chat["prompt_token_ids"]
    tokens, first = _run(runtime, ids[:30])
    assert first.cached_tokens == 0
    assert len(runtime.session_ids()) == 1  # kept
    turn = ids[:30] + tokens + ids[30:36]
    got, done = _run(runtime, turn)
    assert done.cached_tokens == 30 + len(tokens) - 1  # the last sampled token was never fed
    assert got == _fresh(runtime, turn)
    assert runtime.session_ids() == [runtime.head.kept._kept[0].engine.session_id]

    # A prompt that would cut what the kept session holds gets a new one while there is room.
    _, whole = _run(runtime, ids)
    assert whole.cached_tokens == 0
    assert len(runtime.session_ids()) == 2
    # Now both are kept: the next such prompt keeps the longest shared prefix of one of them.
    # (the least recently used of the two sharing most), and what it held after is not read.
    branch = ids[:30] + ids[-10:]
    got, back = _run(runtime, branch)
    assert back.cached_tokens == 30
    assert got == _fresh(runtime, branch)
    # The whole prompt again: all but its last token is held; its logits are llama.cpp's.
    _, again = _run(runtime, ids)
    assert again.cached_tokens == len(ids) - 1
    assert again.prompt_logits is not None
    assert np.abs(again.prompt_logits - chat["f32"]["logits"]).max() <= F32_TOLERANCE


def test_kept_sessions_are_bounded_and_close_when_idle(runtime: NodeRuntime, clock: FakeTime) -> None:
    for start in (5, 50, 90):  # prompts sharing nothing: the third closes the least recently used
        _run(runtime, list(range(start, start + 8)))
        clock.advance(1.0)
    assert len(runtime.session_ids()) == 2
    assert _run(runtime, list(range(5, 14)))[1].cached_tokens == 0  # the first was closed
    assert _run(runtime, list(range(90, 99)))[1].cached_tokens == 8
    clock.advance(IDLE_S)
    assert runtime.head.kept.expire() == 2
    assert runtime.session_ids() == []

    # Three generations at once, each on its own session: when they end, two are kept.
    requests = [
        GenerateRequest(tuple(range(s, s + 8)), 3, n_ctx=N_CTX, keep_session=True) for s in (5, 50, 90)
    ]
    running = [iter(runtime.generate(r)) for r in requests]
    for events in running:
        next(events)
    assert len(runtime.session_ids()) == 3
    for events in running:
        assert isinstance(list(events)[-1], GenerationDone)
    assert len(runtime.session_ids()) == 2


def test_a_kept_session_the_node_lost_falls_back_to_the_whole_prompt(
    runtime: NodeRuntime, chat: dict[str, Any]
) -> None:
    ids = chat["prompt_token_ids"]
    tokens, _ = _run(runtime, ids[:20])
    (lost,) = runtime.session_ids()
    runtime.close_session(lost)  # as a restart, a cut or a bound would end it on some node
    turn = ids[:20] + tokens + ids[20:30]
    got, done = _run(runtime, turn)
    assert done.cached_tokens == 0
    assert got == _fresh(runtime, turn)
    assert len(runtime.session_ids()) == 1
    assert runtime.session_ids() != [lost]


def test_a_new_plan_and_a_stop_end_the_kept_sessions(runtime: NodeRuntime, chat: dict[str, Any]) -> None:
    ids = chat["prompt_token_ids"]
    _run(runtime, ids[:20])
    runtime.load_plan(solo_plan(epoch=2), "solo", WireDType.F32)
    got, done = _run(runtime, ids[:25])
    assert done.cached_tokens == 0
    assert got == _fresh(runtime, ids[:25])
    assert len(runtime.session_ids()) == 1
    assert runtime.stop_taking_work() == []  # the kept one was idle: nothing to wait for
    assert runtime.session_ids() == []


def test_a_request_that_does_not_ask_is_not_kept(
    runtime: NodeRuntime, clock: FakeTime, chat: dict[str, Any]
) -> None:
    """A one-shot run (prima run) frees its session's memory on every node at once, and a
    later request that continues it runs whole."""
    clock.advance(IDLE_S)
    runtime.head.kept.expire()
    ids = chat["prompt_token_ids"]
    tokens, _ = _run(runtime, ids[:20], keep=False)
    assert runtime.session_ids() == []
    assert _run(runtime, ids[:20] + tokens, keep=False)[1].cached_tokens == 0


def test_without_keep_sessions_each_session_closes_with_its_generation(
    tiny_daemon_model: LoadedModel,
) -> None:
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=0, threads=1)
    runtime.load_plan(solo_plan(), "solo", WireDType.F32)
    try:
        tokens, _ = _run(runtime, [5, 6, 7])
        assert runtime.session_ids() == []
        assert _run(runtime, [5, 6, 7, *tokens])[1].cached_tokens == 0
    finally:
        runtime.shutdown()


def test_a_new_session_without_room_closes_the_kept_ones(
    tiny_daemon_model: LoadedModel, chat: dict[str, Any]
) -> None:
    """Kept sessions count against the node's bounds, and give way to a request that needs one."""
    runtime = NodeRuntime(
        tiny_daemon_model,
        "solo",
        budget_bytes=0,
        threads=1,
        bounds=DaemonLimits(max_sessions=1),
        keep_sessions=2,
    )
    runtime.load_plan(solo_plan(), "solo", WireDType.F32)
    try:
        ids = chat["prompt_token_ids"]
        _run(runtime, ids[:20])
        (kept,) = runtime.session_ids()
        other = [t + 1 for t in ids[:20]]  # shares nothing: a new session, and no room for it
        got, done = _run(runtime, other)
        assert done.cached_tokens == 0
        assert got == _fresh(runtime, other)
        assert len(runtime.session_ids()) == 1
        assert runtime.session_ids() != [kept]
    finally:
        runtime.shutdown()
