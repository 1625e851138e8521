"""Byte-level BPE (GGUF `tokenizer.ggml.model = gpt2`), matching llama.cpp's `llm_tokenizer_bpe`.

Text is split by the pre-tokenizer regexes llama.cpp uses for the vocabulary's `tokenizer.ggml.pre`
(`prima.model.pre_tokenizers`), each piece is mapped byte-by-byte onto printable characters (GPT-2's
byte-to-unicode table), and merges are applied by rank, over the vocabulary and merge list as
the GGUF maps them (prima.model.token_index). HF `tokenizers` would hold both as hash maps of
strings (~12 MiB for a 49k vocabulary, more than a small model's KV cache) and its library
another ~5 MiB resident; the `regex` module runs the same patterns in ~1.5 MiB. Special tokens
are handled in `prima.model.tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import regex

from prima.errors import TokenizerError
from prima.model.pair_merge import merge_pairs
from prima.model.pre_tokenizers import pre_tokenizer
from prima.model.token_index import TokenIndex

_WORD_CACHE_SIZE = 8192  # words kept with their ids; cleared when full (a prompt repeats words)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table: printable Latin-1 bytes map to
    themselves, the rest (space, controls, ...) to code points from 256 upward, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_ENCODER = bytes_to_unicode()
_BYTE_DECODER = {ch: b for b, ch in _BYTE_ENCODER.items()}


class ByteLevelBPE:
    """Encodes raw text fragments (no special tokens inside) to ids; decodes normal tokens to bytes."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre: str) -> None:
        spec = pre_tokenizer(pre)
        for line in merges:
            if " " not in line:
                raise TokenizerError(
                    f"malformed merge {line!r} in tokenizer.ggml.merges; the GGUF is damaged"
                )
        # Later duplicate tokens win, as in llama.cpp's token_to_id map; earlier duplicate merges
        # win, as in its bpe_ranks map. A merge's rank is its line number.
        self._vocab = TokenIndex(tokens)
        self._ranks = TokenIndex(merges, later_duplicates_win=False)
        self._ignore_merges = spec.ignore_merges
        try:
            self._splits = [regex.compile(p) for p in spec.regexes]
        except regex.error as exc:  # prima's own table: a bad pattern is a bug, named here
            raise TokenizerError(f"pre-tokenizer {pre!r} has a pattern regex rejects: {exc}") from exc
        self._words: dict[str, list[int]] = {}

    def encode_fragment(self, text: str, *, after_special: bool) -> list[int]:
        """Token ids of `text`; `after_special` is irrelevant for byte-level BPE."""
        del after_special
        ids: list[int] = []
        for word in self.words(text):
            word_ids = self._words.get(word)
            if word_ids is None:
                if len(self._words) >= _WORD_CACHE_SIZE:
                    self._words.clear()
                word_ids = self._words[word] = self._encode_word(word)
            ids.extend(word_ids)
        return ids

    def words(self, text: str) -> list[str]:
        """`text` split by each pattern in turn (every match and every gap between matches a
        piece of its own, empty ones dropped), each piece's UTF-8 bytes as byte-level chars."""
        pieces = [text] if text else []
        for pattern in self._splits:
            split: list[str] = []
            for piece in pieces:
                end = 0
                for match in pattern.finditer(piece):
                    a, b = match.span()
                    split += [part for part in (piece[end:a], piece[a:b]) if part]
                    end = b
                if end < len(piece):
                    split.append(piece[end:])
            pieces = split
        return ["".join(_BYTE_ENCODER[b] for b in piece.encode("utf-8")) for piece in pieces]

    def _encode_word(self, word: str) -> list[int]:
        """One pre-tokenized word: lowest-rank pair merged first (leftmost on ties), over a linked
        list of symbols (spans of `word`), as llama.cpp's llm_tokenizer_bpe_session does."""
        vocab = self._vocab
        if self._ignore_merges:
            whole = vocab.get(word)
            if whole is not None:
                return [whole]
        ranks = self._ranks
        out: list[int] = []
        for piece in merge_pairs(word, lambda left, right: ranks.get(f"{left} {right}")):
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp falls back to the symbol's single bytes that are tokens
                out.extend(t for t in (vocab.get(ch) for ch in piece if ch < "\x80") if t is not None)
        return out

    @staticmethod
    def normal_piece(text: str) -> bytes:
        """Bytes of a NORMAL token: undo the byte-to-unicode mapping character by character."""
        try:
            return bytes(_BYTE_DECODER[ch] for ch in text)
        except KeyError:
            # Not a byte-level string (some vocabularies hold raw text); emit it as UTF-8.
            return text.encode("utf-8")
