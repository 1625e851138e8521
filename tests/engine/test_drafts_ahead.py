"""Drafting while a check travels the ring: the guesses made during a check are the drafts the
next pass would have proposed anyway, are used only when the check went as guessed, and the
tokens stay plain decoding's. A tiny Qwen drafts for itself (every guess right)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from prima.engine.draft_model import DraftModel
from prima.engine.drafts_ahead import DraftsAhead, checks_over_network, drafts_ahead
from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.speculative import DraftConfig, PromptLookup
from prima.forward.loader import load_model
from tests.conftest import tiny_model_path

N_CTX = 128


class _EngineOverANetwork(LocalEngine):
    """This device's engine, declared to check drafts over a network as a ring's head does, so
    that sample_tokens drafts ahead while it checks."""

    checks_over_network = True


@pytest.fixture(scope="module")
def draft_model() -> DraftModel:
    loaded = load_model(str(tiny_model_path("tiny-qwen2")), threads=2)
    return DraftModel(loaded, loaded.model.config.vocab_size)


def test_only_a_ring_head_with_a_draft_model_drafts_ahead(draft_model: DraftModel) -> None:
    here = LocalEngine(draft_model.loaded.model, N_CTX)
    ring = _EngineOverANetwork(draft_model.loaded.model, N_CTX)
    assert not checks_over_network(here)
    assert checks_over_network(ring)
    model = DraftConfig("model", 3)
    drafter = draft_model.drafter(N_CTX)
    assert drafts_ahead(drafter, model, here) is None
    assert drafts_ahead(None, model, ring) is None
    assert drafts_ahead(PromptLookup(), DraftConfig("lookup", 3), ring) is None
    assert isinstance(drafts_ahead(drafter, model, ring), DraftsAhead)


HISTORY = [5, 9, 2, 14, 7]


def _checked(draft_model: DraftModel, k: int) -> tuple[LocalEngine, list[int], DraftsAhead, np.ndarray]:
    """The tiny model's own k drafts after HISTORY, checked through a DraftsAhead on an engine
    holding HISTORY but its last token: (the engine, the drafts, the DraftsAhead, the logits)."""
    target = LocalEngine(draft_model.loaded.model, N_CTX)
    target.forward(HISTORY[:-1])
    drafts = draft_model.drafter(N_CTX).propose(HISTORY, k)
    ahead = DraftsAhead(draft_model.drafter(N_CTX), max_drafts=k)
    return target, drafts, ahead, ahead.check(target.forward_all, HISTORY, drafts)


def test_guesses_made_during_a_check_are_the_next_passs_drafts(draft_model: DraftModel) -> None:
    _, drafts, ahead, rows = _checked(draft_model, 3)
    # The check's logits are the engine's own.
    again = LocalEngine(draft_model.loaded.model, N_CTX)
    again.forward(HISTORY[:-1])
    np.testing.assert_array_equal(rows, again.forward_all([HISTORY[-1], *drafts]))
    # The model drafts for itself, so the check keeps every draft and samples its next guess:
    # the guesses after it are what a fresh drafter proposes for that history.
    after = [*HISTORY, *drafts, int(np.argmax(rows[-1]))]
    assert ahead.take(after, 3) == draft_model.drafter(N_CTX).propose(after, 3)
    assert ahead.take(after, 3) == []  # used once


def test_guesses_are_dropped_when_the_check_went_otherwise(draft_model: DraftModel) -> None:
    target, drafts, ahead, rows = _checked(draft_model, 2)
    sampled = int(np.argmax(rows[-1]))
    other = (sampled + 1) % draft_model.n_shared
    assert ahead.take([*HISTORY, *drafts, other], 2) == []  # another token than guessed
    rejected = ([*HISTORY, drafts[0], other], 2)  # the check rejected the second draft
    none_wanted = ([*HISTORY, *drafts, sampled], 0)  # as guessed, but the next pass drafts nothing
    for history, n_tokens in (rejected, none_wanted):
        target.rewind(len(HISTORY) - 1)
        ahead.check(target.forward_all, HISTORY, drafts)
        assert ahead.take(history, n_tokens) == []


def test_a_failed_check_raises_on_the_generating_thread(draft_model: DraftModel) -> None:
    ahead = DraftsAhead(draft_model.drafter(N_CTX), max_drafts=2)

    def broken(ids: list[int]) -> np.ndarray:
        raise ConnectionError("node1 vanished")

    with pytest.raises(ConnectionError, match="node1 vanished"):
        ahead.check(broken, [5, 9, 2], [14])


def test_drafting_ahead_keeps_plain_decodings_tokens_and_uses_its_guesses(
    draft_model: DraftModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    real_take = DraftsAhead.take

    def counting_take(self: DraftsAhead, history: list[int], n_tokens: int) -> list[int]:
        got = real_take(self, history, n_tokens)
        taken.append(len(got))
        return got

    monkeypatch.setattr(DraftsAhead, "take", counting_take)
    model = draft_model.loaded.model
    plain = GenerateRequest((5, 9, 2, 14, 7), 24, n_ctx=N_CTX)
    want = [t for t in sample_tokens(LocalEngine(model, N_CTX), plain) if isinstance(t, int)]
    request = replace(plain, draft=DraftConfig("model", 3))
    events = list(sample_tokens(_EngineOverANetwork(model, N_CTX), request, draft_model=draft_model))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    assert [t for t in events if isinstance(t, int)] == want
    assert done.accepted_tokens > 0
    assert sum(taken) > 0  # some passes checked drafts guessed during the check before
