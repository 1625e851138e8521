"""The pair-merging loop both tokenizers share: SentencePiece merges the best-scoring pair, BPE the
lowest-ranked one; both merge leftmost first on ties, over a linked list of spans of the text,
as llama.cpp's tokenizer sessions do."""

from __future__ import annotations

import heapq
from collections.abc import Callable


def merge_pairs(text: str, priority: Callable[[str, str], float | None]) -> list[str]:
    """`text` split into pieces by merging, again and again, the adjacent pair of pieces whose
    `priority(left, right)` is smallest (leftmost on ties; None: never merge), starting from
    single characters."""
    n = len(text)
    start = list(range(n))
    length = [1] * n
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    # Heap entries: (priority, left, right, merged length); smallest tuple = best pair.
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        a, b = start[left], start[right]
        p = priority(text[a : a + length[left]], text[b : b + length[right]])
        if p is not None:
            heapq.heappush(heap, (p, left, right, length[left] + length[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        # Stale entry: one side was merged away or grew since this pair was queued.
        if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
            continue
        length[left] = size
        length[right] = 0
        nxt[left] = nxt[right]
        if nxt[left] != -1:
            prev[nxt[left]] = left
        if prev[left] != -1:
            push(prev[left], left)
        if nxt[left] != -1:
            push(left, nxt[left])
    pieces = []
    i = 0 if n else -1
    while i != -1:
        pieces.append(text[start[i] : start[i] + length[i]])
        i = nxt[i]
    return pieces
