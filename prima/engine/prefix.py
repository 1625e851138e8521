"""Which held KV cache a request should continue: choices over token ids, shared by this
device's engine pool (prima.engine.local) and a ring head's kept sessions (prima.daemon), and
how an engine is made to hold the part of a prompt it already computed (reuse_prefix)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class PrefixEngine(Protocol):
    """An engine whose KV cache outlives a generation: `held_tokens` are the ids at the
    positions it holds, and `rewind(n)` keeps the first n of them. A request that starts with
    some of them computes only the rest (reuse_prefix)."""

    @property
    def held_tokens(self) -> Sequence[int]: ...

    def rewind(self, n_past: int) -> None: ...


class ResettableEngine(Protocol):
    """Any engine: reset() forgets every position it holds."""

    def reset(self) -> None: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def choose_held(held: Sequence[Sequence[int]], prompt: Sequence[int], can_grow: bool) -> int | None:
    """The index of the cache (each given by the ids it holds, least recently used first) that
    `prompt` should continue, or None for a new one.

    A cache whose every id the prompt starts with loses nothing: the longest such wins. Else,
    while `can_grow`, a new cache, so no conversation is cut; once full, the cache sharing the
    longest prefix, or, sharing none, the one used least recently."""
    shared = [common_prefix(h, prompt) for h in held]
    extends = [i for i, h in enumerate(held) if shared[i] == len(h)]
    if extends:
        return max(extends, key=shared.__getitem__)
    if can_grow or not held:
        return None
    best = max(range(len(held)), key=shared.__getitem__)
    return best if shared[best] > 0 else 0


def reuse_prefix(engine: ResettableEngine, prompt: Sequence[int]) -> int:
    """Make `engine` hold a prefix of `prompt` and return its length: the longest prefix its
    cache shares with the prompt (a PrefixEngine), but never the prompt's last token, whose
    logits the first sample needs; otherwise reset it and return 0."""
    if isinstance(engine, PrefixEngine):
        keep = min(common_prefix(engine.held_tokens, prompt), len(prompt) - 1)
        if keep > 0:
            engine.rewind(keep)
            return keep
    engine.reset()
    return 0
