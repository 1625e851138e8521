"""Failover in the default mode (int8 activations in the matmuls, float16 KV cache), on free text
with the default micro-batch, so that prompts run through batched prefill, whose arithmetic
differs from decode's: after every kind of fault the generation equals the failure-free run
token for token, greedy and seeded, because the new ring rebuilds its caches with the bits the
unbroken run had (the prompt prefilled as before, the generated tokens fed as decoding fed them).

One ring of seven daemons carries the story, one generation per fault on the nodes left by the
one before: a follower killed (SIGKILL), a follower hung (SIGSTOP), two followers killed at once,
the head killed, the head hung."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest

from prima.coordinator.failover import FailoverRing, RingSpec
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model

from .conftest import N_CTX, start_ring

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
# Early, so that most of the text is sampled from the rebuilt caches: when the replay prefilled
# the generated tokens in one batch, every run below differed from token 13 or 21 on.
FAULT_AT = 5
PROMPT_TEXT = "Once upon a time, in a small village by the sea, there lived a girl who"
GREEDY = SamplerConfig()
SEEDED = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
Action = Callable[[LocalRing], None]


@cache
def prompt(model_path: Path) -> tuple[int, ...]:
    return tuple(prompt_ids(load_model(model_path, layers=range(0)).tokenizer, PROMPT_TEXT))


def request(model_path: Path, sampler: SamplerConfig) -> GenerateRequest:
    """Default mode's micro-batch (ubatch 0: the engine's, 128): the prompt is one batched prefill."""
    return GenerateRequest(prompt(model_path), MAX_TOKENS, sampler, n_ctx=N_CTX)


@cache
def unbroken_tokens(model_path: Path, sampler: SamplerConfig) -> list[int]:
    """The failure-free run, on one device in the default mode (a ring gives exactly these)."""
    engine = LocalEngine(load_model(model_path).model, n_ctx=N_CTX)
    events = sample_tokens(engine, request(model_path, sampler))
    return [e for e in events if not isinstance(e, GenerationDone)]


@pytest.fixture(scope="module")
def seven_nodes(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(7, smollm2_path, ring_logs / "q8", extra_args=())


def generate_with(
    ring: FailoverRing, local: LocalRing, req: GenerateRequest, at: int, action: Action
) -> list[int]:
    """The tokens of `req` on `ring`, doing `action` once token `at` has arrived."""
    tokens: list[int] = []
    for i, event in enumerate(ring.generate(req)):
        if isinstance(event, GenerationDone):
            break
        tokens.append(event)
        if i == at:
            action(local)
    return tokens


def kill(*indices: int) -> Action:
    def act(local: LocalRing) -> None:
        for i in indices:
            local.kill(i)

    return act


def pause(index: int) -> Action:
    return lambda local: local.pause(index)


def test_every_fault_leaves_the_text_of_the_failure_free_run(
    seven_nodes: LocalRing, smollm2_path: Path
) -> None:
    ring = FailoverRing(Ring.connect(seven_nodes.addresses), RingSpec(tuple(seven_nodes.addresses)))
    faults: list[tuple[str, SamplerConfig, Action, list[str]]] = [
        ("a follower killed", GREEDY, kill(6), [f"node{i}" for i in range(6)]),
        ("a follower hung", SEEDED, pause(5), [f"node{i}" for i in range(5)]),
        ("two followers killed at once", GREEDY, kill(3, 4), ["node0", "node1", "node2"]),
        ("the head killed", SEEDED, kill(0), ["node1", "node2"]),
        ("the head hung", GREEDY, pause(1), ["node2"]),
    ]
    try:
        unbroken = ring.generate(request(smollm2_path, GREEDY))
        assert [e for e in unbroken if not isinstance(e, GenerationDone)] == unbroken_tokens(
            smollm2_path, GREEDY
        )
        for what, sampler, action, left in faults:
            tokens = generate_with(ring, seven_nodes, request(smollm2_path, sampler), FAULT_AT, action)
            assert tokens == unbroken_tokens(smollm2_path, sampler), what
            assert len(ring.recoveries) == 1, what
            assert [n.node_id for n in ring.plan.nodes] == left, what
        assert all(info.sessions == 0 for info in ring.info())
    finally:
        ring.close()
