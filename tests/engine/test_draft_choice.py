"""With a draft model, each pass drafts by prompt lookup or by the model, whichever has lately
guessed better: a generation is simulated over a known text with a scripted draft model, and the
tiny Qwen drafts for itself through the same choice while the tokens stay plain decoding's."""

from __future__ import annotations

from collections.abc import Sequence

from prima.engine.draft_choice import LOOKUP, MODEL, LookupOrModel, drafter, model_drafter
from prima.engine.draft_model import DraftModel
from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.speculative import DraftConfig, PromptLookup
from prima.forward.loader import load_model
from tests.conftest import tiny_model_path


class _ScriptedModel:
    """A draft model's drafter that guesses `text` right (or, with `wrong`, always token 0)."""

    def __init__(self, text: list[int], wrong: bool = False) -> None:
        self.text = text
        self.wrong = wrong
        self.calls = 0

    def propose(self, context: Sequence[int], n_tokens: int) -> list[int]:
        self.calls += 1
        if self.wrong:
            return [0] * n_tokens
        return self.text[len(context) : len(context) + n_tokens]


def _generate(choice: LookupOrModel, text: list[int], start: int, n_drafts: int = 3) -> list[str]:
    """Run the drafting loop over `text` from `start` as a check would (kept drafts, then the
    true token); the source of each pass's drafts ("" when none)."""
    sources = []
    n = start
    while n < len(text):
        before = dict(choice.passes)
        drafts = choice.propose(text[:n], n_drafts)
        sources.append(next((s for s in (LOOKUP, MODEL) if choice.passes[s] > before[s]), ""))
        kept = 0
        while kept < len(drafts) and n + kept < len(text) and drafts[kept] == text[n + kept]:
            kept += 1
        n += kept + 1
    return sources


def test_repeating_text_drafts_by_lookup_and_spares_the_model() -> None:
    text = [7, 8, 9, 10, 11, 12] * 6
    model = _ScriptedModel(text)
    sources = _generate(LookupOrModel(PromptLookup(), model), text, start=8)
    assert sources
    assert all(s == LOOKUP for s in sources)
    assert model.calls == 0


def test_lookup_that_guesses_wrong_gives_way_to_the_model() -> None:
    # Each "1 2" is followed by a new token: lookup always has a match, and it is always wrong.
    text = [t for i in range(30) for t in (1, 2, 100 + i)]
    model = _ScriptedModel(text)
    choice = LookupOrModel(PromptLookup(), model)
    sources = _generate(choice, text, start=5, n_drafts=1)
    assert sources[0] == LOOKUP  # a tie at the start goes to lookup, which costs nothing
    assert sources[-5:] == [MODEL] * 5
    assert choice.rates[LOOKUP] < choice.rates[MODEL]


def test_lookup_scored_while_unused_comes_back_when_text_repeats() -> None:
    fresh = [200 + i for i in range(40)]  # nothing repeats: a wrong model drafts, lookup has no match
    text = fresh + [5, 6, 7, 8] * 10
    model = _ScriptedModel(text, wrong=True)
    choice = LookupOrModel(PromptLookup(), model)
    sources = _generate(choice, text, start=2)
    assert MODEL in sources[:10]
    assert sources[-3:] == [LOOKUP] * 3


def test_a_draft_config_picks_the_drafter() -> None:
    assert drafter(DraftConfig(), 64) is None
    assert isinstance(drafter(DraftConfig("lookup", 3), 64), PromptLookup)
    inner = _ScriptedModel([])

    class _Source:
        def drafter(self, n_ctx: int) -> _ScriptedModel:
            return inner

    both = drafter(DraftConfig("model", 3), 64, _Source())
    assert isinstance(both, LookupOrModel)
    assert model_drafter(both) is inner  # guesses ahead of a check skip lookup
    assert model_drafter(inner) is inner


def test_the_tiny_model_drafting_with_lookup_keeps_plain_tokens() -> None:
    loaded = load_model(str(tiny_model_path("tiny-qwen2")), threads=2)
    draft = DraftModel(loaded, loaded.model.config.vocab_size)
    prompt = [3, 17, 5, 9, 3, 17, 5, 9, 3, 17]

    def run(config: DraftConfig) -> tuple[list[int], GenerationDone]:
        engine = LocalEngine(loaded.model, 128)
        events = list(sample_tokens(engine, GenerateRequest(prompt, 40, draft=config), draft_model=draft))
        done = events[-1]
        assert isinstance(done, GenerationDone)
        return [e for e in events if isinstance(e, int)], done

    plain, _ = run(DraftConfig())
    drafted, done = run(DraftConfig("model", 3))
    assert drafted == plain
    assert done.accepted_tokens > 0
