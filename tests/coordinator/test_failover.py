"""The request a failover sends the new ring: the tokens so far end the prompt, the budget and
the sampler's step move on by as many, and the caller's prompt logits are not asked of it. The
nodes a re-plan asks: the known ones, then those a browse finds now."""

from __future__ import annotations

from prima.coordinator.failover import Recovery, RingSpec, continuation
from prima.engine.generate import GenerateRequest
from prima.engine.sampling import SamplerConfig


def test_continuation_carries_on_after_the_tokens_so_far() -> None:
    req = GenerateRequest(
        (5, 6), 10, SamplerConfig(temperature=0.8, seed=1), (0,), n_ctx=64, want_prompt_logits=True
    )
    rest = continuation(req, [7, 8, 9])
    assert rest.prompt_ids == (5, 6, 7, 8, 9)
    assert (rest.max_tokens, rest.first_step, rest.want_prompt_logits) == (7, 3, False)
    assert (rest.sampler, rest.stop_ids, rest.n_ctx) == (req.sampler, req.stop_ids, req.n_ctx)
    assert continuation(rest, [1]).first_step == 4


def test_recovery_reports_rounded_times() -> None:
    r = Recovery("node2 gone", 12, 5013.4567, 2030.1, 421.98765, ("node0", "node1"))
    assert r.as_dict() == {
        "error": "node2 gone",
        "at_token": 12,
        "detect_ms": 5013.457,
        "replan_ms": 2030.1,
        "replay_ms": 421.988,
        "nodes": ["node0", "node1"],
    }


def test_replan_asks_the_known_nodes_then_the_newly_found() -> None:
    known = ("h:1", "h:2", "h:3")
    assert RingSpec(known).candidates() == list(known)
    browsed = RingSpec(known, discover=lambda: ["h:4", "h:2", "h:5"])
    assert browsed.candidates() == ["h:1", "h:2", "h:3", "h:4", "h:5"]
