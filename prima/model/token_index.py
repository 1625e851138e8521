"""Token text -> id for a whole vocabulary, without a Python str per token.

A dict over gemma's 262k tokens holds ~45 MiB (a str, an int and a slot each), more than the
rest of the tokenizer and the KV cache together. This keeps 12 bytes a token: the texts' hashes
sorted, with their ids; a lookup binary-searches the hash and confirms the text against the
vocabulary itself (a StringArray over the mapped GGUF header), so a collision never matches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenIndex:
    """Index by exact text, as a dict {text: index} would give it: where several entries share a
    text, the last one wins (llama.cpp's token_to_id map), or with `later_duplicates_win` off
    the first (its bpe_ranks map of merges)."""

    def __init__(self, tokens: Sequence[str], *, later_duplicates_win: bool = True) -> None:
        self._tokens = tokens
        self._last = later_duplicates_win
        # str hashes are salted per process, and this index lives only in this one.
        hashes = np.fromiter((hash(t) for t in tokens), dtype=np.int64, count=len(tokens))
        order = np.argsort(hashes, kind="stable")  # equal hashes stay in id order
        self._hashes = hashes[order]
        self._ids = order.astype(np.int32)

    def __len__(self) -> int:
        return len(self._tokens)

    def get(self, text: str) -> int | None:
        """The index of the entry whose text is `text`, or None."""
        h = hash(text)
        hashes = self._hashes
        if self._last:  # from the highest index with this hash down
            i, step = int(np.searchsorted(hashes, h, side="right")) - 1, -1
        else:
            i, step = int(np.searchsorted(hashes, h, side="left")), 1
        while 0 <= i < hashes.size and hashes[i] == h:
            tid = int(self._ids[i])
            if self._tokens[tid] == text:
                return tid
            i += step
        return None
