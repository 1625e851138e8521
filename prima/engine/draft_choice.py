"""Prompt lookup or the draft model, pass by pass: whichever has lately guessed better.

Prompt lookup costs nothing to run and is right where text repeats (code, lists, an answer
quoting its prompt); a draft model guesses on any text, at the cost of its forward passes. With
a draft model, each pass asks lookup first, and its drafts go to the check when lookup has
lately guessed at least as well as the model (they save the model's passes); else the model
drafts. How well each source guesses is scored on the context itself, against the tokens that
did follow the point where it guessed, so lookup is scored on passes where its guesses went
unused too (they cost nothing to make) and comes back when text starts to repeat.

Only the speed depends on this choice: the check decides every token (generate.sample_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prima.engine.speculative import DraftConfig, Drafter, DraftSource, PromptLookup
from prima.errors import InputError

LOOKUP = "lookup"
MODEL = "model"
# Weight of a source's newest scored guess in its running rate of guessed tokens that followed:
# a few passes turn the choice, one unlucky pass does not.
NEWEST = 0.3
START_RATE = 0.5  # both sources' rate before any guess is scored (a tie goes to lookup)


@dataclass
class _Guess:
    source: str
    at: int  # the context's length when the guess was made: guesses[0] would be token `at`
    tokens: list[int]


class LookupOrModel:
    """A Drafter over prompt lookup and a draft model's drafter (see the module docstring).
    Contexts given to `propose` must be the generation's own (each extends the last); guesses
    made on a context that includes unchecked drafts (prima.engine.drafts_ahead) go to `model`
    directly."""

    def __init__(self, lookup: PromptLookup, model: Drafter) -> None:
        self.lookup = lookup
        self.model = model
        self.rates = {LOOKUP: START_RATE, MODEL: START_RATE}
        self.passes = {LOOKUP: 0, MODEL: 0}  # passes each source drafted for
        self._unscored: list[_Guess] = []

    def propose(self, context: Sequence[int], n_tokens: int) -> list[int]:
        """Up to `n_tokens` drafts after `context`: lookup's if it has a match and has lately
        guessed at least as well as the model, else the model's."""
        self._score(context)
        guesses = self.lookup.propose(context, n_tokens)  # indexes the context even when n is 0
        if n_tokens <= 0:
            return []
        if guesses:
            self._unscored.append(_Guess(LOOKUP, len(context), guesses))
            if self.rates[LOOKUP] >= self.rates[MODEL]:
                self.passes[LOOKUP] += 1
                return guesses
        drafts = self.model.propose(context, n_tokens)
        if drafts:
            self._unscored.append(_Guess(MODEL, len(context), drafts))
            self.passes[MODEL] += 1
        return drafts

    def _score(self, context: Sequence[int]) -> None:
        """Fold into each source's rate the guesses whose tokens the context now shows: the
        share of the shown tokens guessed right before the first wrong one."""
        waiting = []
        for guess in self._unscored:
            shown = list(context[guess.at : guess.at + len(guess.tokens)])
            if not shown:
                waiting.append(guess)
                continue
            right = 0
            while right < len(shown) and shown[right] == guess.tokens[right]:
                right += 1
            rate = self.rates[guess.source]
            self.rates[guess.source] = (1 - NEWEST) * rate + NEWEST * right / len(shown)
        self._unscored = waiting


def drafter(config: DraftConfig, n_ctx: int, model: DraftSource | None = None) -> Drafter | None:
    """The drafter of a generation over a context of `n_ctx` tokens, or None for plain
    decoding; `model` is the draft model where the generation runs, if it has one. A draft
    model drafts together with prompt lookup (LookupOrModel)."""
    if config.method == LOOKUP:
        return PromptLookup()
    if config.method == MODEL:
        if model is None:
            raise InputError("--draft model needs a draft model here: give --draft-model PATH_OR_NAME")
        return LookupOrModel(PromptLookup(), model.drafter(n_ctx))
    return None


def model_drafter(drafts_from: Drafter) -> Drafter:
    """The draft model's own drafter within `drafts_from`, for guesses on contexts that hold
    unchecked drafts (prompt lookup indexes every context it sees as final)."""
    return drafts_from.model if isinstance(drafts_from, LookupOrModel) else drafts_from
