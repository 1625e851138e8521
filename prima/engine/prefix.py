"""Which held KV cache a request should continue: pure choices over token ids, shared by this
device's engine pool (prima.engine.local) and a ring head's kept sessions (prima.daemon)."""

from __future__ import annotations

from collections.abc import Sequence


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
