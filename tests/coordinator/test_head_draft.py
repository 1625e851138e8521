"""A ring's head and the draft model a request asks for: refused at a fresh start, replaced by
prompt lookup after a failover, untouched when the head has it or no model is asked for."""

from __future__ import annotations

import pytest

from prima.coordinator.head_draft import check_head_drafts, fall_back, head_draft_problem
from prima.engine.generate import GenerateRequest
from prima.engine.speculative import DraftConfig
from prima.errors import InputError
from prima.net.node_status import NodeStatus

OURS = "a" * 64
OTHER = "b" * 64


def _head(draft_fingerprint: str = "", draft_name: str = "") -> NodeStatus:
    return NodeStatus(
        "node1", 1, "SmolLM2", "f" * 64, 30, 576, True, "ready",
        draft_model_name=draft_name, draft_model_fingerprint=draft_fingerprint,
    )  # fmt: skip


def _request(draft: DraftConfig) -> GenerateRequest:
    return GenerateRequest((1, 2, 3), 8, draft=draft)


@pytest.mark.parametrize(
    ("draft", "head"),
    [
        (DraftConfig("model", 4, OURS), _head(OURS, "draft")),
        (DraftConfig("model", 4), _head(OTHER, "any")),  # "" asks for the head's own
        (DraftConfig("lookup", 4), _head()),
        (DraftConfig(), _head()),
    ],
)
def test_head_that_drafts_as_asked_keeps_the_request(draft: DraftConfig, head: NodeStatus) -> None:
    request = _request(draft)
    assert head_draft_problem(draft, head) == ""
    check_head_drafts(draft, head)
    assert fall_back(request, head) == (request, "")


def test_head_without_a_draft_model_falls_back_to_lookup_of_as_many_tokens() -> None:
    request, reason = fall_back(_request(DraftConfig("model", 5, OURS)), _head())
    assert request.draft == DraftConfig("lookup", 5)
    assert request.prompt_ids == (1, 2, 3)
    assert (
        reason
        == "node node1 (the ring's head) has no draft model after a failover: drafted by prompt lookup instead"
    )


def test_head_with_another_draft_model_is_named_with_both_fingerprints() -> None:
    problem = head_draft_problem(DraftConfig("model", 3, OURS), _head(OTHER, "Qwen-tiny"))
    assert "drafts with Qwen-tiny" in problem
    assert OTHER[:12] in problem
    assert OURS[:12] in problem
    request, reason = fall_back(_request(DraftConfig("model", 3, OURS)), _head(OTHER, "Qwen-tiny"))
    assert request.draft.method == "lookup"
    assert reason.startswith(problem)


def test_fresh_start_on_a_head_without_it_is_refused_with_the_fix() -> None:
    with pytest.raises(
        InputError, match="has no draft model: start its primad with --draft-model PATH_OR_NAME"
    ):
        check_head_drafts(DraftConfig("model", 3), _head())
    with pytest.raises(
        InputError, match="drafts with Qwen-tiny .*omit --draft-model to draft with the head's own"
    ):
        check_head_drafts(DraftConfig("model", 3, OURS), _head(OTHER, "Qwen-tiny"))
