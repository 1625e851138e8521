"""A generation survives nodes leaving the ring: a follower or the head killed (SIGKILL), a
follower hung (SIGSTOP), two failures in one run; SmolLM2 on rings of 3 and 4, Gemma on 3.
Every run streams exactly the tokens of the unbroken run, greedy, and its streamed text is its
final text; no daemon keeps the session. A long prefill, which keeps every node busy, is not
taken for a failure."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest

from prima.coordinator.failover import FailoverRing, RingSpec
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerationResult, TokenEvent, generate, stream_text
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.forward.loader import load_model
from prima.net.liveness import Liveness

from .conftest import GREEDY, N_CTX, UBATCH, ring_request, start_ring

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
BIG_UBATCH = 256  # one micro-batch of a long prompt: each node computes it in one long stretch
PROMPT_TEXT = "The capital of France is"
Action = Callable[[LocalRing], None]


@cache
def prompt(model_path: Path) -> tuple[int, ...]:
    return tuple(prompt_ids(load_model(model_path, layers=range(0)).tokenizer, PROMPT_TEXT))


@cache
def unbroken_tokens(model_path: Path) -> tuple[int, ...]:
    """The failure-free run's tokens (one device; rings give exactly these, see test_ring.py)."""
    loaded = load_model(model_path, mode="exact")
    engine = LocalEngine(loaded.model, n_ctx=N_CTX, ubatch=UBATCH)
    return tuple(generate(engine, prompt(model_path), max_tokens=MAX_TOKENS, sampler=GREEDY).token_ids)


@pytest.fixture
def three_nodes(smollm2_path: Path, ring_logs: Path, request: pytest.FixtureRequest) -> Iterator[LocalRing]:
    yield from start_ring(3, smollm2_path, ring_logs / request.node.name)


@pytest.fixture
def three_gemma_nodes(
    gemma3_path: Path, ring_logs: Path, request: pytest.FixtureRequest
) -> Iterator[LocalRing]:
    yield from start_ring(3, gemma3_path, ring_logs / request.node.name)


@pytest.fixture
def four_nodes(smollm2_path: Path, ring_logs: Path, request: pytest.FixtureRequest) -> Iterator[LocalRing]:
    yield from start_ring(4, smollm2_path, ring_logs / request.node.name)


def run_with_failures(
    local: LocalRing, model_path: Path, failures: dict[int, Action]
) -> tuple[list[str], GenerationResult, FailoverRing]:
    """Generate on a ring of every daemon, doing `failures[k]` once token k has arrived."""
    ring = FailoverRing(Ring.connect(local.addresses), RingSpec(tuple(local.addresses)))

    def events() -> Iterator[TokenEvent]:
        for i, event in enumerate(ring.generate(ring_request(prompt(model_path), MAX_TOKENS))):
            yield event
            if i in failures:
                failures[i](local)

    decoder = load_model(model_path, layers=range(0)).tokenizer.stream_decoder()
    try:
        out = list(stream_text(events(), prompt(model_path), decoder=decoder))
    except BaseException:
        ring.close()
        raise
    result = out.pop()
    assert isinstance(result, GenerationResult)
    return [str(piece) for piece in out], result, ring


def check_run(
    pieces: list[str], result: GenerationResult, ring: FailoverRing, model_path: Path, at: list[int]
) -> None:
    try:
        assert tuple(result.token_ids) == unbroken_tokens(model_path), f"failures after tokens {at}"
        assert "".join(pieces) == result.text
        # Tokens already on their way may arrive after the failure: recoveries start no earlier.
        assert len(ring.recoveries) == len(at)
        assert all(r.at_token >= k + 1 for r, k in zip(ring.recoveries, at, strict=True))
        assert all(info.sessions == 0 for info in ring.info())
    finally:
        ring.close()


def test_killed_follower_is_replaced_mid_generation(three_nodes: LocalRing, smollm2_path: Path) -> None:
    at = random.Random(1).randrange(4, 48)
    pieces, result, ring = run_with_failures(three_nodes, smollm2_path, {at: lambda r: r.kill(2)})
    assert [n.node_id for n in ring.plan.nodes] == ["node0", "node1"]
    check_run(pieces, result, ring, smollm2_path, [at])


def test_killed_head_hands_its_role_on(three_nodes: LocalRing, smollm2_path: Path) -> None:
    at = random.Random(2).randrange(4, 48)
    pieces, result, ring = run_with_failures(three_nodes, smollm2_path, {at: lambda r: r.kill(0)})
    assert ring.plan.head.node_id == "node1"
    check_run(pieces, result, ring, smollm2_path, [at])


def test_hung_follower_is_found_and_left_out(three_nodes: LocalRing, smollm2_path: Path) -> None:
    at = random.Random(3).randrange(4, 48)
    pieces, result, ring = run_with_failures(three_nodes, smollm2_path, {at: lambda r: r.pause(1)})
    assert [n.node_id for n in ring.plan.nodes] == ["node0", "node2"]
    assert "node1" in ring.recoveries[0].error
    check_run(pieces, result, ring, smollm2_path, [at])


def test_two_failures_in_one_run(three_nodes: LocalRing, smollm2_path: Path) -> None:
    first, second = sorted(random.Random(4).sample(range(4, 60), 2))
    failures: dict[int, Action] = {first: lambda r: r.kill(1), second: lambda r: r.kill(0)}
    pieces, result, ring = run_with_failures(three_nodes, smollm2_path, failures)
    assert [n.node_id for n in ring.plan.nodes] == ["node2"]
    check_run(pieces, result, ring, smollm2_path, [first, second])


def test_gemma_survives_a_follower_then_the_head(three_gemma_nodes: LocalRing, gemma3_path: Path) -> None:
    """The second test model, greedy: its sliding-window layers and tied head replayed onto the
    nodes left, twice, the second time onto a new head."""
    first, second = sorted(random.Random(5).sample(range(4, 60), 2))
    failures: dict[int, Action] = {first: lambda r: r.kill(2), second: lambda r: r.kill(0)}
    pieces, result, ring = run_with_failures(three_gemma_nodes, gemma3_path, failures)
    assert [n.node_id for n in ring.plan.nodes] == ["node1"]
    check_run(pieces, result, ring, gemma3_path, [first, second])


def test_a_ring_of_four_survives_a_follower_then_the_head(four_nodes: LocalRing, smollm2_path: Path) -> None:
    first, second = sorted(random.Random(6).sample(range(4, 60), 2))
    failures: dict[int, Action] = {first: lambda r: r.kill(3), second: lambda r: r.kill(0)}
    pieces, result, ring = run_with_failures(four_nodes, smollm2_path, failures)
    assert [n.node_id for n in ring.plan.nodes] == ["node1", "node2"]
    check_run(pieces, result, ring, smollm2_path, [first, second])


def test_gemma_leaves_a_hung_follower_out(three_gemma_nodes: LocalRing, gemma3_path: Path) -> None:
    at = random.Random(7).randrange(4, 48)
    pieces, result, ring = run_with_failures(three_gemma_nodes, gemma3_path, {at: lambda r: r.pause(2)})
    assert [n.node_id for n in ring.plan.nodes] == ["node0", "node1"]
    assert "node2" in ring.recoveries[0].error
    check_run(pieces, result, ring, gemma3_path, [at])


def test_long_prefill_on_busy_nodes_is_not_a_failure(three_nodes: LocalRing, smollm2_path: Path) -> None:
    """Big micro-batches of a long prompt keep each node computing for long stretches, during
    which no token comes: this side probes the head every 0.2 s, and the head its followers
    whenever a second passes, and every probe must be answered in time."""
    text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 16)
    ids = prompt_ids(load_model(smollm2_path, layers=range(0)).tokenizer, text)
    loaded = load_model(smollm2_path, mode="exact")
    engine = LocalEngine(loaded.model, n_ctx=N_CTX, ubatch=BIG_UBATCH)
    expected = generate(engine, ids, max_tokens=4, sampler=GREEDY).token_ids
    eager = Liveness(quiet_s=0.2, probe_timeout_s=1.0, misses=2, give_up_s=300.0)
    ring = FailoverRing(
        Ring.connect(three_nodes.addresses), RingSpec(tuple(three_nodes.addresses)), liveness=eager
    )
    try:
        events = list(ring.generate(ring_request(ids, 4, ubatch=BIG_UBATCH)))
        assert events[:-1] == expected
        assert ring.recoveries == []
        assert [n.node_id for n in ring.plan.nodes] == ["node0", "node1", "node2"]
    finally:
        ring.close()
