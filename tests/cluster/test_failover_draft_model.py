"""A generation drafting with the head's draft model survives the head's death onto a head that
has none: real primad processes, node0 started with --draft-model, node1 without. The run goes
on drafting by prompt lookup, its tokens are the unbroken run's, and the coordinator says why
(one warning, GenerationDone.draft_off). A fresh start on a head without the draft model is
refused before any generation."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from prima.coordinator.failover import FailoverRing, RingSpec
from prima.coordinator.head_draft import check_head_drafts
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerationDone
from prima.engine.prompt import prompt_ids
from prima.engine.speculative import DraftConfig
from prima.errors import InputError
from prima.forward.loader import load_model
from prima.model.gguf_file import GGUFFile
from tests.conftest import REPEAT_TEXT

from .conftest import reference_tokens, ring_request, start_ring

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
KILL_AT = 6  # tokens out before node0, the drafting head, is killed


@pytest.fixture
def drafting_head_and_plain_node(
    smollm2_path: Path, ring_logs: Path, request: pytest.FixtureRequest
) -> Iterator[LocalRing]:
    yield from start_ring(
        2,
        smollm2_path,
        ring_logs / request.node.name,
        node_args=[("--draft-model", str(smollm2_path)), ()],
    )


def test_failover_to_a_head_without_the_draft_model_goes_on_with_lookup(
    drafting_head_and_plain_node: LocalRing, smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = drafting_head_and_plain_node
    ids = prompt_ids(load_model(smollm2_path, layers=range(0)).tokenizer, REPEAT_TEXT)
    draft = DraftConfig("model", 3, GGUFFile(smollm2_path).fingerprint())
    ring = FailoverRing(Ring.connect(local.addresses), RingSpec(tuple(local.addresses)))
    try:
        check_head_drafts(draft, ring.ring.head.info())  # node0 drafts with it: a fresh start runs
        events = []
        with caplog.at_level(logging.WARNING, logger="prima.coordinator"):
            for i, event in enumerate(ring.generate(replace(ring_request(ids, MAX_TOKENS), draft=draft))):
                events.append(event)
                if i == KILL_AT:
                    local.kill(0)
        done = events.pop()
        assert isinstance(done, GenerationDone)
        assert events == reference_tokens(smollm2_path, ids, MAX_TOKENS)
        assert ring.plan.head.node_id == "node1"
        assert len(ring.recoveries) == 1
        assert "node1 (the ring's head) has no draft model" in done.draft_off
        assert "prompt lookup" in done.draft_off
        assert done.draft_tokens > 0  # the new head drafted: by lookup, on this repeating text
        warnings = [r.getMessage() for r in caplog.records if "drafts changed" in r.getMessage()]
        assert warnings == [f"drafts changed: {done.draft_off}"]
        # A fresh start with node1 as the head is refused, naming the fix.
        with pytest.raises(InputError, match="node1 \\(the ring's head\\) has no draft model.*--draft-model"):
            check_head_drafts(draft, ring.ring.head.info())
    finally:
        ring.close()
