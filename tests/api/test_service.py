"""The engine queue: first come first served, bounded, and a waiter that gives up leaves cleanly;
and the chat template a request is rendered with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from prima import metrics
from prima.api.openai_schema import ChatMessage, GenerationRequest
from prima.api.service import CompletionService, EngineQueue, ServerBusyError, final_result, request_outcome
from prima.engine.generate import GenerationResult, LocalGenerator
from prima.engine.local import LocalEngine
from prima.errors import ContextFullError, GenerationCancelled, ProtocolError, UntrustedNodeError
from prima.forward.loader import load_model
from prima.net.liveness import NodeGoneError
from tests.tiny_models import CHATML_TEMPLATE, write_tiny_model

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


def test_chat_template_given_to_the_service_renders_chat_requests(tmp_path: Path) -> None:
    """`prima serve --chat-template FILE`: chat requests use that template, not the fallback."""
    loaded = load_model(write_tiny_model(tmp_path / "bare.gguf", chat_template=None), mode="exact")
    req = GenerationRequest(kind="chat", model=None, messages=(ChatMessage("user", "hi"),))
    engine = LocalEngine(loaded.model, n_ctx=64)
    generator = LocalGenerator(engine)
    fallback = CompletionService(loaded, generator, "bare", 64).prepare(req)
    given = CompletionService(loaded, generator, "bare", 64, chat_template=CHATML_TEMPLATE).prepare(req)
    chatml = loaded.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", parse_special=True
    )
    assert given.prompt_ids == chatml
    assert fallback.prompt_ids != chatml


def test_slots_let_that_many_run_at_once_and_the_rest_wait_in_turn() -> None:
    q = EngineQueue(poll_s=0.01, slots=2)
    q.acquire(_never, timeout_s=JOIN_S)
    assert not q.busy
    q.acquire(_never, timeout_s=JOIN_S)
    assert q.busy
    assert q.running == 2
    got = threading.Event()

    def third() -> None:
        q.acquire(_never, timeout_s=JOIN_S)
        got.set()

    t = threading.Thread(target=third)
    t.start()
    _wait_until(lambda: q.waiting == 1)
    assert not got.is_set()
    q.release()  # the place passes to the waiter: still two running
    t.join(JOIN_S)
    assert got.is_set()
    assert q.running == 2
    q.release()
    q.release()
    assert q.running == 0
    assert not q.busy


@pytest.mark.parametrize(
    ("exc", "outcome"),
    [
        (GenerationCancelled("the client went away"), "cancelled"),
        (GeneratorExit(), "cancelled"),
        (ServerBusyError("retry later"), "busy"),
        (ContextFullError("the context is full"), "bad_request"),
        (NodeGoneError("node1 stopped answering", ("node1",)), "node_lost"),
        (UntrustedNodeError("not a member"), "node_lost"),
        (ProtocolError("a malformed message"), "error"),
        (RuntimeError("a bug"), "error"),
    ],
)
def test_request_outcomes_are_short_documented_labels(exc: BaseException, outcome: str) -> None:
    assert request_outcome(exc) == outcome
    assert outcome in metrics.REQUEST_OUTCOMES


def test_final_result_skips_the_text_and_returns_the_result() -> None:
    result = GenerationResult([1, 2], [3], text="ab")
    assert final_result(iter(["a", "b", result])) is result
    with pytest.raises(AssertionError, match="always ends"):
        final_result(iter(["a"]))
