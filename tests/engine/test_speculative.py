"""Speculative decoding on one device: prompt lookup drafts what followed the context's suffix
before, and the generation loop keeps exactly plain decoding's tokens (greedy and seeded) while
checking several drafts per pass. The loop runs on the tiny Qwen models (tests/tiny_qwen.py, fast)
and, marked slow, on every oracle prompt of both test models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import MAX_DRAFT_TOKENS, DraftConfig, DraftLength, PromptLookup
from prima.errors import InputError
from prima.forward.loader import LoadedModel, load_model
from tests.conftest import ORACLE_TAGS, load_oracle, load_tiny_oracle, tiny_model_path
from tests.tiny_models import write_tiny_model
from tests.tiny_qwen import TINY_TAGS

LOOKUP = DraftConfig("lookup", 3)
# Both test models continue this by repeating it: drafts get checked and kept.
REPEAT_TEXT = (
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday,"
)
SEEDED = SamplerConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11)


# -- prompt lookup -------------------------------------------------------------------------------
def test_lookup_continues_the_latest_earlier_match() -> None:
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert PromptLookup().propose(ctx, 2) == [7, 8]  # "2 3" last followed by 7, 8 (not 9)


def test_lookup_prefers_the_longest_ngram() -> None:
    ctx = [8, 2, 3, 5, 9, 2, 3, 6, 8, 2, 3]
    # "8 2 3" (three tokens) occurred at the start, followed by 5; "2 3" alone last by 6.
    assert PromptLookup().propose(ctx, 1) == [5]


def test_lookup_without_a_match_drafts_nothing() -> None:
    look = PromptLookup()
    assert look.propose([1, 2, 3, 4], 3) == []
    assert look.propose([1, 2, 3, 4, 5], 0) == []


def test_lookup_indexes_the_context_as_it_grows() -> None:
    look = PromptLookup()
    ctx = [1, 2, 3]
    assert look.propose(ctx, 3) == []
    ctx += [1, 2]
    assert look.propose(ctx, 3) == [3, 1, 2]  # the repeat overlaps its own suffix


def test_draft_length_grows_with_kept_drafts_and_backs_off_after_misses() -> None:
    length = DraftLength(3)
    assert length.next(left=10) == 3
    assert length.next(left=2) == 2  # never past the token budget
    length.record(drafted=3, kept=1)
    assert length.next(left=10) == 2  # one more than it kept
    length.record(drafted=2, kept=2)
    assert length.next(left=10) == 3  # all kept: one more, up to the maximum
    # A pass that keeps nothing pauses drafting for 1 step, the next such pass for 2, then 4.
    paused = []
    for _ in range(3):
        length.record(drafted=1, kept=0)
        steps = [length.next(left=10) for _ in range(9)]
        paused.append(steps.index(1))
    assert paused == [1, 2, 4]
    length.record(drafted=1, kept=1)  # a kept draft ends the back-off
    length.record(drafted=2, kept=0)
    assert [length.next(left=10) for _ in range(2)] == [0, 1]


def test_draft_config_names_the_bad_value() -> None:
    with pytest.raises(InputError, match="unknown draft method 'medusa'"):
        DraftConfig("medusa")
    with pytest.raises(InputError, match=f"--draft-max must be between 1 and {MAX_DRAFT_TOKENS}, got 0"):
        DraftConfig("lookup", 0)


# -- the loop on tiny models ---------------------------------------------------------------------
@cache
def _loaded(path: str, mode: str = "exact") -> LoadedModel:
    return load_model(path, mode=mode)


def _run(loaded: LoadedModel, request: GenerateRequest) -> tuple[list[int], GenerationDone]:
    events = list(sample_tokens(LocalEngine(loaded.model, n_ctx=request.n_ctx), request))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    return [t for t in events if isinstance(t, int)], done


def _tiny(tag: str) -> LoadedModel:
    return _loaded(str(tiny_model_path(tag)))


@pytest.mark.parametrize(
    ("tag", "sampler"),
    [*((tag, SamplerConfig()) for tag in TINY_TAGS), (TINY_TAGS[0], SEEDED)],
    ids=[*(f"{tag}-greedy" for tag in TINY_TAGS), f"{TINY_TAGS[0]}-seeded"],
)
def test_drafts_keep_plain_decodings_tokens_on_tiny_models(tag: str, sampler: SamplerConfig) -> None:
    loaded = _tiny(tag)
    drafted = accepted = 0
    for prompt in load_tiny_oracle(tag)["prompts"]:
        plain = GenerateRequest(tuple(prompt["prompt_token_ids"]), 16, sampler, n_ctx=512)
        want, _ = _run(loaded, plain)
        if sampler.greedy:  # llama.cpp's own greedy run, as far as it went
            oracle = prompt["f32"]["greedy_token_ids"]
            assert want[: len(oracle)] == oracle[: len(want)]
        for k in (1, 5):
            got, done = _run(loaded, replace(plain, draft=DraftConfig("lookup", k)))
            assert got == want, f"{prompt['name']}, --draft-max {k}"
            assert done.accepted_tokens <= done.draft_tokens
            drafted += done.draft_tokens
            accepted += done.accepted_tokens
    assert accepted > 0  # the tiny models repeat themselves: drafts were checked and kept


def test_drafts_stop_at_the_budget_and_at_a_stop_id() -> None:
    loaded = _tiny("tiny-qwen2")
    prompt = load_tiny_oracle("tiny-qwen2")["prompts"][0]
    plain = GenerateRequest(tuple(prompt["prompt_token_ids"]), 12, SamplerConfig(), n_ctx=256)
    want, _ = _run(loaded, plain)
    for n in (0, 1, 2, 5):  # budgets shorter than a pass's drafts
        got, _ = _run(loaded, replace(plain, max_tokens=n, draft=LOOKUP))
        assert got == want[:n]
    stop = want[6]
    got, done = _run(loaded, replace(plain, stop_ids=(stop,), draft=LOOKUP))
    assert got == want[: want.index(stop)]
    assert done.stop_reason == "eos"


def test_a_full_context_ends_the_drafting_run_like_the_plain_one() -> None:
    loaded = _tiny("tiny-qwen3")
    ids = tuple(load_tiny_oracle("tiny-qwen3")["prompts"][0]["prompt_token_ids"])
    plain = GenerateRequest(ids, 100, SamplerConfig(), n_ctx=len(ids) + 9)
    want, _ = _run(loaded, plain)
    got, done = _run(loaded, replace(plain, draft=DraftConfig("lookup", 8)))
    assert (got, done.stop_reason) == (want, "length")
    assert len(got) == 9


# -- every oracle prompt of the test models ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tag", ORACLE_TAGS)
def test_drafts_keep_plain_decodings_tokens_on_every_oracle_prompt(
    tag: str, oracle: Callable[[str], dict[str, Any]]
) -> None:
    """The CPU checks drafts in batches of four whose rows are bit-identical to single tokens,
    so even near-ties between two tokens come out as plain decoding decides them. The oracle's
    prompts seldom repeat within a few tokens; REPEAT_TEXT makes sure drafts are also kept."""
    loaded = _loaded(tag, "q8")
    stops = tuple(sorted(loaded.tokenizer.stop_ids))
    prompts = [p["prompt_token_ids"] for p in oracle(tag)["prompts"]]
    accepted = 0
    for ids in [*prompts, prompt_ids(loaded.tokenizer, REPEAT_TEXT)]:
        plain = GenerateRequest(tuple(ids), 16, SamplerConfig(), stops, n_ctx=512)
        want, _ = _run(loaded, plain)
        got, done = _run(loaded, replace(plain, draft=LOOKUP))
        assert got == want, f"{tag} prompt {ids[:8]}..."
        accepted += done.accepted_tokens
    assert accepted > 0


@pytest.mark.slow
def test_rows_of_a_verified_batch_equal_tokens_run_alone(smollm2_path: Path) -> None:
    """The promise forward_all rests on: logits of a token inside a batch are bit for bit those
    of the token fed alone after the same context."""
    loaded = _loaded(str(smollm2_path), "q8")
    ids = load_oracle("smollm2-135m")["prompts"][1]["prompt_token_ids"]
    alone = LocalEngine(loaded.model, n_ctx=128)
    alone.forward(ids[:-6])
    rows = np.stack([alone.forward([t]) for t in ids[-6:]])
    batched = LocalEngine(loaded.model, n_ctx=128)
    batched.forward(ids[:-6])
    np.testing.assert_array_equal(batched.forward_all(ids[-6:]), rows)
    batched.rewind(len(ids) - 4)  # drop the last four, check them again
    np.testing.assert_array_equal(batched.forward_all(ids[-4:]), rows[-4:])


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_rows_of_a_verified_batch_equal_tokens_run_alone_with_half_weights(
    qtype: str, tmp_path: Path
) -> None:
    """The same promise for 16-bit float weights, which check drafts in batches too."""
    path = write_tiny_model(tmp_path / f"{qtype}.gguf", qtype=GGMLQuantizationType[qtype], n_layers=3)
    model = load_model(str(path), mode="q8").model
    assert model.backend.batch_identical_tokens > 1
    ids = [5, 9, 2, 14, 7, 30, 11, 3, 21, 8]
    alone = LocalEngine(model, n_ctx=64)
    alone.forward(ids[:-4])
    rows = np.stack([alone.forward([t]) for t in ids[-4:]])
    batched = LocalEngine(model, n_ctx=64)
    batched.forward(ids[:-4])
    np.testing.assert_array_equal(batched.forward_all(ids[-4:]).view(np.uint32), rows.view(np.uint32))
    batched.rewind(len(ids) - 3)  # drop the last three, check them again
    np.testing.assert_array_equal(batched.forward_all(ids[-3:]).view(np.uint32), rows[-3:].view(np.uint32))
