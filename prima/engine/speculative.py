"""Draft tokens for speculative decoding: guesses at the next few tokens, cheap to make, that the
model then checks all at once (one forward pass of the last token and the drafts instead of one
pass per token; on a ring, one trip round it).

Two drafts: prompt lookup (here) and a small draft model (prima.engine.draft_model). Prompt
lookup guesses, when the last few tokens of the context (prompt and generated so far) occurred
earlier in it, that what followed then follows again. It costs no second model and pays off on
repetitive text: code, lists, answers that quote the prompt. A draft model sharing the target's
vocabulary guesses on any text, at the cost of running it; with one, each pass takes whichever
of the two has lately guessed better (prima.engine.draft_choice).

Drafts never change the output: generate.sample_tokens samples every position from the model's
own logits, exactly as plain decoding would, and keeps a draft token only where the sample
equals it (see there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prima.errors import InputError

DRAFT_METHODS: tuple[str, ...] = ("none", "lookup", "model")
DEFAULT_DRAFT_MAX = 3  # the last token + 3 drafts = 4 rows: one batch of the CPU's fused kernels
# On a ring kept drafts share a trip round it, and the head drafts ahead while a check travels
# (prima.engine.drafts_ahead), so longer drafts pay there (docs/performance.md).
RING_DRAFT_MAX = 5
MAX_DRAFT_TOKENS = 16  # more is never accepted often enough to pay for its rows
# Longest and shortest n-gram looked up; longer matches are tried first (they guess better).
NGRAM_MAX = 3
NGRAM_MIN = 2


@dataclass(frozen=True)
class DraftConfig:
    """How a generation drafts: `method` "none" (plain decoding), "lookup" (prompt lookup) or
    "model" (a draft model where the generation runs), proposing up to `max_tokens` tokens per
    verification pass. `model_fingerprint` names the draft model the caller expects (its
    GGUFFile.fingerprint; "" for whichever the engine has), so a ring's head drafting with
    another model is an error, not a silent change of speed (after a failover, a logged fallback
    to prompt lookup: prima.coordinator.head_draft)."""

    method: str = "none"
    max_tokens: int = DEFAULT_DRAFT_MAX
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise InputError(
                f"unknown draft method {self.method!r}; choose one of {', '.join(DRAFT_METHODS)}"
            )
        if not 1 <= self.max_tokens <= MAX_DRAFT_TOKENS:
            raise InputError(f"--draft-max must be between 1 and {MAX_DRAFT_TOKENS}, got {self.max_tokens}")
        if self.model_fingerprint and not _is_sha256_hex(self.model_fingerprint):
            raise InputError(
                f"a draft model's fingerprint is 64 hex digits, not {self.model_fingerprint[:80]!r}"
            )
        if self.model_fingerprint and self.method != "model":
            raise InputError(f"a draft model was named with --draft {self.method}; drop one of them")


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


class Drafter(Protocol):
    """Proposes draft tokens to continue a context. Called once per verification pass with the
    whole context so far, which only grows: rejected drafts never enter it."""

    def propose(self, context: Sequence[int], n_tokens: int) -> list[int]: ...


class DraftSource(Protocol):
    """A draft model loaded once and shared by generations, each drafting with its own state."""

    def drafter(self, n_ctx: int) -> Drafter: ...


class PromptLookup:
    """Drafts by n-gram lookup in the context. The context only grows (rejected drafts never
    enter it), so an index of where each n-gram was last followed is kept up to date in O(1)
    per new token."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {ngram_min}..{ngram_max}")
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._indexed = 0  # tokens of the context indexed so far

    def propose(self, context: Sequence[int], n_tokens: int) -> list[int]:
        """Up to `n_tokens` tokens that followed the latest earlier occurrence of the longest
        matching suffix of `context`; [] when no suffix occurred before."""
        self._index(context)
        if n_tokens <= 0:
            return []
        for n in self.sizes:
            if len(context) <= n:
                continue
            start = self._follows.get(tuple(context[-n:]))
            if start is not None:
                return [int(t) for t in context[start : start + n_tokens]]
        return []

    def _index(self, context: Sequence[int]) -> None:
        # Token i is indexed as the follower of the n-grams ending at i - 1. The context's own
        # suffix is thus indexed only once a token follows it: a lookup finds an earlier match.
        for i in range(max(self._indexed, 1), len(context)):
            for n in self.sizes:
                if i >= n:
                    self._follows[tuple(context[i - n : i])] = i
        self._indexed = max(self._indexed, len(context))


class DraftLength:
    """How many drafts to check next, from how the last ones fared. A rejected draft costs a row
    of compute for nothing (on the CPU a 4-row pass costs well over a 1-row one), so on text that
    does not repeat, drafting must back off: after a pass that kept none of its drafts the next
    `pause` steps draft nothing, and `pause` doubles with each such pass (up to PAUSE_MAX); a
    pass that kept some resets it and allows one more draft than it kept; one that kept all
    allows one more than it tried. Only the speed depends on this: the output never does."""

    PAUSE_MAX = 16

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.length = max_tokens
        self._pause = 1
        self._skip = 0

    def next(self, left: int) -> int:
        """Drafts to propose for the next pass (0: decode one token plainly); `left` bounds it."""
        if self._skip:
            self._skip -= 1
            return 0
        return max(0, min(self.length, left))

    def record(self, drafted: int, kept: int) -> None:
        if kept == 0:
            self._skip = self._pause
            self._pause = min(2 * self._pause, self.PAUSE_MAX)
            self.length = 1
            return
        self._pause = 1
        self.length = min(self.max_tokens, kept + 1)
