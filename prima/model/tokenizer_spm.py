"""SentencePiece-style tokenizer (GGUF `tokenizer.ggml.model = llama`), matching llama.cpp's
`llm_tokenizer_spm`.

This is not unigram Viterbi: llama.cpp starts from single characters and repeatedly merges the
adjacent pair whose concatenation is a vocabulary token with the highest score (ties: leftmost
pair first). Whatever is left that is not a token falls back to `<0xNN>` byte tokens.
Spaces are written as U+2581 (`▁`) before merging.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from prima.model.pair_merge import merge_pairs
from prima.model.token_index import TokenIndex

SPACE_MARK = "\u2581"


class SentencePieceBPE:
    """Encodes raw text fragments (no special tokens inside) to ids; decodes normal tokens to bytes.

    Build once per vocabulary: indexing a 262k vocabulary costs tens of ms.
    """

    def __init__(
        self, tokens: Sequence[str], scores: np.ndarray, *, add_space_prefix: bool, unk_id: int
    ) -> None:
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self._index = TokenIndex(tokens)
        # array('f'): 4 bytes a score and Python floats on indexing (a list of floats costs ~32).
        self._scores = array("f", scores.astype(np.float32).tobytes())
        self._add_space_prefix = add_space_prefix
        byte_ids = (self._index.get(f"<0x{b:02X}>") for b in range(256))
        self._byte_ids = [unk_id if i is None else i for i in byte_ids]

    def encode_fragment(self, text: str, *, after_special: bool) -> list[int]:
        """Token ids of one raw-text fragment. llama.cpp prefixes a space only to fragments that
        start the text or follow a special token, and only if the vocabulary asks for it."""
        if self._add_space_prefix and after_special:
            text = " " + text
        text = text.replace(" ", SPACE_MARK)
        if not text:
            return []
        return self._merge(text)

    def _merge(self, text: str) -> list[int]:
        """Highest-score-first pair merging over a linked list of symbols (spans of `text`)."""
        scores = self._scores
        index = self._index
        known: dict[str, int | None] = {}  # this text's lookups: its pieces recur as merges go on

        def lookup(piece: str) -> int | None:
            tid = known.get(piece, -1)
            if tid == -1:
                tid = known[piece] = index.get(piece)
            return tid

        def priority(left: str, right: str) -> float | None:
            tid = lookup(left + right)
            return None if tid is None else -scores[tid]

        out: list[int] = []
        for piece in merge_pairs(text, priority):
            tid = lookup(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_ids[b] for b in piece.encode("utf-8"))
        return out

    @staticmethod
    def normal_piece(text: str) -> bytes:
        """Bytes of a NORMAL token: `▁` back to a space."""
        return text.replace(SPACE_MARK, " ").encode("utf-8")
