"""Speculative decoding with a draft model: a second GGUF sharing the target's vocabulary guesses
greedily from its own KV cache, which follows the context (rewound past rejected drafts), and
the output stays plain decoding's, greedy and seeded. The two tiny Qwen models (tests/tiny_qwen.py)
and SmolLM2 share one vocabulary; Gemma's differs. Fast on the tiny models; marked slow, every
oracle prompt of both test models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from prima.engine.draft_model import DraftModel, load_draft_model, shared_vocabulary
from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.local import LocalEngine, local_generator
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.errors import InputError
from prima.forward.loader import LoadedModel, load_model
from prima.model.files import open_model
from tests.conftest import ORACLE_TAGS, REPEAT_TEXT, load_tiny_oracle, tiny_model_path

SEEDED = SamplerConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11)
MODEL_DRAFT = DraftConfig("model", 3)


@cache
def _loaded(path: str, mode: str = "exact") -> LoadedModel:
    return load_model(path, mode=mode)


@cache
def _draft(draft_path: str, target_path: str, mode: str = "exact") -> DraftModel:
    return load_draft_model(draft_path, _loaded(target_path, mode), mode=mode)


def _run(
    loaded: LoadedModel, request: GenerateRequest, draft: DraftModel | None = None
) -> tuple[list[int], GenerationDone]:
    engine = LocalEngine(loaded.model, n_ctx=request.n_ctx)
    events = list(sample_tokens(engine, request, draft_model=draft))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    return [t for t in events if isinstance(t, int)], done


def _tiny(tag: str) -> str:
    return str(tiny_model_path(tag))


# -- the vocabulary check ------------------------------------------------------------------------
def test_models_with_one_tokenizer_share_every_id(smollm2_path: Path) -> None:
    qwen2 = open_model(tiny_model_path("tiny-qwen2"), layers=range(0))
    qwen3 = open_model(tiny_model_path("tiny-qwen3"), layers=range(0))
    smollm2 = open_model(smollm2_path, layers=range(0))
    n_tokens = len(qwen2.gguf.metadata["tokenizer.ggml.tokens"])
    assert shared_vocabulary(qwen2, qwen3) == n_tokens
    assert shared_vocabulary(smollm2, qwen2) == min(n_tokens, smollm2.config.vocab_size)


def test_a_draft_with_another_vocabulary_is_refused_naming_both(
    smollm2_path: Path, gemma3_path: Path
) -> None:
    smollm2 = open_model(smollm2_path, layers=range(0))
    gemma3 = open_model(gemma3_path, layers=range(0))
    with pytest.raises(InputError) as err:
        shared_vocabulary(smollm2, gemma3)
    message = str(err.value)
    assert str(gemma3_path) in message
    assert str(smollm2_path) in message
    assert "token 0 is" in message
    assert "--draft lookup" in message


def test_draft_config_checks_the_fingerprint() -> None:
    with pytest.raises(InputError, match="64 hex digits"):
        DraftConfig("model", 3, "not-a-fingerprint")
    with pytest.raises(InputError, match="--draft lookup"):
        DraftConfig("lookup", 3, "0" * 64)
    with pytest.raises(InputError, match="--draft-model PATH_OR_NAME"):
        _run(_loaded(_tiny("tiny-qwen2")), GenerateRequest((1, 2, 3), 4, draft=MODEL_DRAFT, n_ctx=64))


# -- the drafter's cache follows the context -----------------------------------------------------
def test_the_drafter_rewinds_to_the_kept_tokens() -> None:
    """After drafts are partly rejected, the next guesses are those of a drafter that never saw
    the rejected ones: the cache was rewound, not merely appended to."""
    draft = _draft(_tiny("tiny-qwen3"), _tiny("tiny-qwen2"))
    context = list(load_tiny_oracle("tiny-qwen2")["prompts"][0]["prompt_token_ids"])
    drafter = draft.drafter(256)
    first = drafter.propose(context, 4)
    assert len(first) == 4
    assert drafter.fed == context + first[:-1]
    assert drafter.engine.n_past == len(drafter.fed)
    # The target keeps one draft, then samples a token the draft model did not guess.
    other = (first[1] + 1) % draft.n_shared
    context += [first[0], other]
    again = drafter.propose(context, 3)
    assert drafter.fed == context + again[:-1]
    assert drafter.engine.n_past == len(drafter.fed)
    assert again == draft.drafter(256).propose(context, 3)
    assert drafter.propose(context, 0) == []


def test_a_context_past_the_drafts_room_drafts_nothing() -> None:
    draft = _draft(_tiny("tiny-qwen3"), _tiny("tiny-qwen2"))
    drafter = draft.drafter(8)
    assert drafter.propose(list(range(1, 7)), 4) == []  # 6 tokens + 3 drafts fed > 8
    assert len(drafter.propose(list(range(1, 7)), 3)) == 3


# -- the loop: plain decoding's tokens -----------------------------------------------------------
@pytest.mark.parametrize(
    ("draft_tag", "sampler"),
    [("tiny-qwen2", SamplerConfig()), ("tiny-qwen3", SamplerConfig()), ("tiny-qwen3", SEEDED)],
    ids=["self-greedy", "other-greedy", "other-seeded"],
)
def test_model_drafts_keep_plain_decodings_tokens_on_tiny_models(
    draft_tag: str, sampler: SamplerConfig
) -> None:
    """tiny-qwen2 drafting for itself keeps every draft; tiny-qwen3 (other random weights,
    the same vocabulary) has most rejected, so the cache is rewound often."""
    target = _loaded(_tiny("tiny-qwen2"))
    draft = _draft(_tiny(draft_tag), _tiny("tiny-qwen2"))
    drafted = accepted = 0
    for prompt in load_tiny_oracle("tiny-qwen2")["prompts"]:
        plain = GenerateRequest(tuple(prompt["prompt_token_ids"]), 16, sampler, n_ctx=512)
        want, _ = _run(target, plain)
        if sampler.greedy:  # llama.cpp's own greedy run, as far as it went
            oracle = prompt["f32"]["greedy_token_ids"]
            assert want[: len(oracle)] == oracle[: len(want)]
        for k in (1, 4):
            got, done = _run(target, replace(plain, draft=DraftConfig("model", k)), draft)
            assert got == want, f"{prompt['name']}, --draft-max {k}"
            assert done.accepted_tokens <= done.draft_tokens
            drafted += done.draft_tokens
            accepted += done.accepted_tokens
    assert drafted > 0
    if draft_tag == "tiny-qwen2":
        assert accepted == drafted
    else:
        assert accepted < drafted


def test_a_pool_of_generations_drafts_with_one_model() -> None:
    """prima serve --parallel: each generation drafts with its own cache, taking turns."""
    target = _loaded(_tiny("tiny-qwen2"))
    draft = _draft(_tiny("tiny-qwen3"), _tiny("tiny-qwen2"))
    pool = local_generator(target, 256, parallel=2, draft_model=draft)
    prompts = [p["prompt_token_ids"] for p in load_tiny_oracle("tiny-qwen2")["prompts"][:2]]
    requests = [GenerateRequest(tuple(ids), 12, n_ctx=256) for ids in prompts]
    want = [_run(target, r)[0] for r in requests]
    # Both generations run interleaved, one step each in turn.
    streams = [pool.generate(replace(r, draft=MODEL_DRAFT)) for r in requests]
    got: list[list[int]] = [[], []]
    live = [True, True]
    for _ in range(100):
        if not any(live):
            break
        for i, stream in enumerate(streams):
            if live[i]:
                event = next(stream)
                if isinstance(event, GenerationDone):
                    live[i] = False
                else:
                    got[i].append(event)
    assert got == want
    pool.close()


# -- every oracle prompt of the test models ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tag", ORACLE_TAGS)
def test_model_drafts_keep_plain_decodings_tokens_on_every_oracle_prompt(
    tag: str, oracle: Callable[[str], dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    """SmolLM2 drafted for by tiny-qwen2 (its vocabulary, random weights: drafts mostly
    rejected), greedy and seeded; Gemma, whose vocabulary no small test model shares, drafting
    for itself (its drafts all kept). The CPU's batches of drafts are bit-identical to single
    tokens, so near-ties come out as plain decoding decides them."""
    path = str(request.getfixturevalue("smollm2_path" if tag == "smollm2-135m" else "gemma3_path"))
    draft_path = _tiny("tiny-qwen2") if tag == "smollm2-135m" else path
    target = _loaded(path, "q8")
    draft = _draft(draft_path, path, "q8")
    stops = tuple(sorted(target.tokenizer.stop_ids))
    prompts = [p["prompt_token_ids"] for p in oracle(tag)["prompts"]]
    runs = [(ids, SamplerConfig()) for ids in prompts]
    if tag == "smollm2-135m":  # (drafting for itself, Gemma keeps every draft on any text)
        runs += [(prompt_ids(target.tokenizer, REPEAT_TEXT), SamplerConfig())]
        runs += [(ids, SEEDED) for ids in prompts[:2]]
    drafted = accepted = 0
    for ids, sampler in runs:
        plain = GenerateRequest(tuple(ids), 12, sampler, stops, n_ctx=512)
        want, _ = _run(target, plain)
        got, done = _run(target, replace(plain, draft=MODEL_DRAFT), draft)
        assert got == want, f"{tag} prompt {ids[:8]}..., {sampler}"
        drafted += done.draft_tokens
        accepted += done.accepted_tokens
    assert drafted > 0
    if draft_path == path:
        # The model's own drafts are all kept; prompt lookup drafts a few passes too
        # (engine.draft_choice), whose guesses may miss until the model outscores it.
        assert accepted >= 0.8 * drafted
