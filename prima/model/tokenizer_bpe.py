"""Byte-level BPE (GGUF `tokenizer.ggml.model = gpt2`), matching llama.cpp's `llm_tokenizer_bpe`.

Text is split by the pre-tokenizer regexes llama.cpp uses for the vocabulary's `tokenizer.ggml.pre`
(`prima.model.pre_tokenizers`), each piece is mapped byte-by-byte onto printable characters (GPT-2's
byte-to-unicode table), and merges are applied by rank. HF `tokenizers` runs those merges; we only
hand it the GGUF's vocab, merges and the right regexes, and keep special-token handling in
`prima.model.tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from prima.errors import TokenizerError
from prima.model.pre_tokenizers import pre_tokenizer


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


_BYTE_DECODER = {ch: b for b, ch in bytes_to_unicode().items()}


class ByteLevelBPE:
    """Encodes raw text fragments (no special tokens inside) to ids; decodes normal tokens to bytes."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre: str) -> None:
        spec = pre_tokenizer(pre)
        # Later duplicates win, as in llama.cpp's token_to_id map.
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = []
        for line in merges:
            left, sep, right = line.partition(" ")
            if not sep:
                raise TokenizerError(
                    f"malformed merge {line!r} in tokenizer.ggml.merges; the GGUF is damaged"
                )
            pairs.append((left, right))
        try:
            hf = HFTokenizer(
                models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=spec.ignore_merges)
            )
        except Exception as exc:  # tokenizers raises a bare Exception on inconsistent vocab/merges
            raise TokenizerError(f"cannot build the BPE vocabulary from the GGUF: {exc}") from exc
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in spec.regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._hf = hf

    def encode_fragment(self, text: str, *, after_special: bool) -> list[int]:
        """Token ids of `text`; `after_special` is irrelevant for byte-level BPE."""
        del after_special
        if not text:
            return []
        return self._hf.encode(text, add_special_tokens=False).ids

    @staticmethod
    def normal_piece(text: str) -> bytes:
        """Bytes of a NORMAL token: undo the byte-to-unicode mapping character by character."""
        try:
            return bytes(_BYTE_DECODER[ch] for ch in text)
        except KeyError:
            # Not a byte-level string (some vocabularies hold raw text); emit it as UTF-8.
            return text.encode("utf-8")
