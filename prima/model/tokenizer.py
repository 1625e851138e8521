"""Text <-> token ids from the vocabulary stored in a GGUF, equal to llama.cpp's tokenization.

Encoding follows llama.cpp's two stages: first the text is split around special tokens (always
USER_DEFINED ones; CONTROL ones too when `parse_special`), longest token text first; then each
remaining raw fragment goes to the vocabulary's own algorithm (`tokenizer_bpe` for `gpt2`,
`tokenizer_spm` for `llama`). Decoding turns each id into bytes and joins them, so a character
split across byte tokens comes out whole; `StreamDecoder` does the same one id at a time.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from prima.errors import TokenizerError
from prima.ggml_constants import TokenType
from prima.model.gguf_file import StringArray
from prima.model.pre_tokenizers import pre_tokenizer
from prima.model.tokenizer_bpe import ByteLevelBPE
from prima.model.tokenizer_spm import SentencePieceBPE

log = logging.getLogger("prima.model")

SUPPORTED_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}

# Control tokens that end a turn; llama.cpp treats the same names as end-of-generation.
END_OF_TURN_NAMES = frozenset(
    {
        "<|im_end|>",
        "<end_of_turn>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<end_of_utterance>",
        "<|return|>",
        "<|call|>",
    }
)

_CACHE_SIZE = 4
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class _FragmentModel(Protocol):
    def encode_fragment(self, text: str, *, after_special: bool) -> list[int]: ...

    def normal_piece(self, text: str) -> bytes: ...


# Vocabulary structures keyed by hashes of everything they are built from, so opening the same model
# again (a new GGUFFile) reuses them: hashing a vocabulary costs a small part of building from it.
_MODEL_CACHE: OrderedDict[int, tuple[tuple[Any, ...], _FragmentModel]] = OrderedDict()


class Tokenizer:
    """A GGUF vocabulary: encode/decode plus the special ids generation needs."""

    def __init__(
        self,
        model: _FragmentModel,
        tokens: Sequence[str],
        token_types: np.ndarray,
        *,
        kind: str,
        bos_id: int | None,
        eos_id: int | None,
        add_bos_default: bool,
        add_space_prefix: bool,
        stop_ids: frozenset[int],
    ) -> None:
        self._model = model
        self._tokens = tokens
        self._types = token_types
        self.kind = kind
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos_default = add_bos_default
        self.add_space_prefix = add_space_prefix
        self.stop_ids = stop_ids
        self._pieces: dict[int, bytes] = {}
        self._user_defined = _SpecialTokens(tokens, token_types, {TokenType.USER_DEFINED})
        self._all_specials = _SpecialTokens(
            tokens, token_types, {TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.UNKNOWN}
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict (`GGUFFile(path).metadata`)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in SUPPORTED_MODELS:
            supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODELS.items())
            raise TokenizerError(
                f"unsupported tokenizer model {kind!r} in tokenizer.ggml.model; prima supports: {supported}"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(
                "the GGUF has no tokenizer.ggml.tokens; re-convert the model with its vocabulary"
            )
        n = len(tokens)
        types = np.asarray(
            meta.get("tokenizer.ggml.token_type", np.full(n, TokenType.NORMAL)), dtype=np.int32
        )
        if len(types) != n:
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; the GGUF is damaged"
            )
        _check_byte_tokens(tokens, types)
        # llama.cpp's defaults when the keys are absent: SPM adds BOS and a space prefix, BPE neither
        # (except the Llama 3 and Tekken vocabularies, which add BOS).
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", kind == "llama"))
        model = _cached_model(meta, kind, tokens, add_space_prefix)
        bos_by_default = kind == "llama" or (kind == "gpt2" and pre_tokenizer(_bpe_pre(meta)).add_bos)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_by_default))
        bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", n)
        eos_id = _optional_id(meta, "tokenizer.ggml.eos_token_id", n)
        stop = {i for i in (eos_id, _optional_id(meta, "tokenizer.ggml.eot_token_id", n)) if i is not None}
        eom = _optional_id(meta, "tokenizer.ggml.eom_token_id", n)
        if eom is not None:
            stop.add(eom)
        for i in np.flatnonzero(types == TokenType.CONTROL).tolist():
            if tokens[i] in END_OF_TURN_NAMES:
                stop.add(i)
        return cls(
            model,
            tokens,
            types,
            kind=kind,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos_default=add_bos,
            add_space_prefix=add_space_prefix,
            stop_ids=frozenset(stop),
        )

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token's string exactly as stored in the vocabulary (e.g. `Ġworld`, `▁world`, `<0x0A>`)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. With `parse_special`, control-token text such as `<|im_start|>`
        becomes that single id; without it, only user-defined tokens are matched whole."""
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("this vocabulary has no BOS token; encode without add_bos")
            ids.append(self.bos_id)
        after_special = True
        for fragment in self._split_specials(
            text, self._all_specials if parse_special else self._user_defined
        ):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids.extend(self._model.encode_fragment(fragment, after_special=after_special))
                after_special = False
        return ids

    def token_piece(self, token_id: int, *, special: bool = False) -> bytes:
        """Bytes this token contributes to decoded text; control tokens are empty unless `special`."""
        self._check_id(token_id)
        kind = int(self._types[token_id])
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            return self._tokens[token_id].encode("utf-8") if special else b""
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self._tokens[token_id]
            if kind == TokenType.USER_DEFINED:
                piece = text.encode("utf-8")
            elif kind == TokenType.BYTE:
                piece = bytes([int(text[3:5], 16)])  # "<0xNN>"
            elif kind == TokenType.UNUSED:
                piece = b""
            else:
                piece = self._model.normal_piece(text)
            self._pieces[token_id] = piece
        return piece

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut-off character) becomes U+FFFD."""
        text = b"".join(self.token_piece(i, special=special) for i in ids).decode("utf-8", errors="replace")
        return self._strip_prefix_space(text)

    def stream_decoder(self, *, special: bool = False) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self, special=special)

    def _strip_prefix_space(self, text: str) -> str:
        # The space SentencePiece added in front of the text is not part of it (llama.cpp's remove_space).
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})"
            )

    @staticmethod
    def _split_specials(text: str, specials: _SpecialTokens) -> list[str | int]:
        """Split `text` into raw fragments and special-token ids, trying each special token in
        turn (longest first) on every still-raw fragment, left to right, as llama.cpp does."""
        fragments: list[str | int] = [text] if text else []
        for token_text, token_id in specials.candidates(text):
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or token_text not in fragment:
                    split.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(token_text)):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments


class _SpecialTokens:
    """Special tokens of some types, indexed by first character so that a prompt is checked only
    against the few whose first character it contains (gemma has ~6400 control tokens)."""

    def __init__(self, tokens: Sequence[str], token_types: np.ndarray, kinds: set[int]) -> None:
        self._by_first: dict[str, list[tuple[str, int]]] = {}
        for i in np.flatnonzero(np.isin(token_types, list(kinds))).tolist():
            if tokens[i]:
                self._by_first.setdefault(tokens[i][0], []).append((tokens[i], i))

    def candidates(self, text: str) -> list[tuple[str, int]]:
        """Special tokens occurring in `text`, longest text first, ties by id: the order in which
        llama.cpp tries them (which matters when two overlap)."""
        found = [
            (t, i)
            for ch in set(text).intersection(self._by_first)
            for t, i in self._by_first[ch]
            if t in text
        ]
        return sorted(found, key=lambda ti: (-len(ti[0]), ti[1]))


class StreamDecoder:
    """Feed ids one at a time; get back only text that is complete UTF-8, the rest is held until
    the following bytes arrive (a CJK character or emoji often spans several byte tokens)."""

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def feed(self, token_id: int) -> str:
        """Text completed by this token (often "", never a partial character)."""
        return self._emit(self._utf8.decode(self._tokenizer.token_piece(token_id, special=self._special)))

    def flush(self) -> str:
        """Whatever is still held at the end of the sequence (incomplete bytes become U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            text = self._tokenizer._strip_prefix_space(text)
        return text


def _check_byte_tokens(tokens: Sequence[str], types: np.ndarray) -> None:
    """TokenizerError unless every BYTE token reads `<0xNN>`: decoding turns it into that byte."""
    for i in np.flatnonzero(types == TokenType.BYTE).tolist():
        text = tokens[i]
        if not (isinstance(text, str) and _BYTE_TOKEN.fullmatch(text)):
            raise TokenizerError(
                f"token {i} is typed BYTE but reads {str(text)[:20]!r}, not <0xNN>; the GGUF's "
                "tokenizer.ggml.token_type or tokens are damaged: re-convert the model"
            )


def _optional_id(meta: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        log.warning("%s = %.20r is not a token id; ignoring it", key, value)
        return None
    value = int(value)
    if not 0 <= value < n_tokens:
        log.warning("%s = %d is outside the vocabulary of %d tokens; ignoring it", key, value, n_tokens)
        return None
    return value


def _cached_model(
    meta: Mapping[str, Any], kind: str, tokens: Sequence[str], add_space_prefix: bool
) -> _FragmentModel:
    """The fragment model for this vocabulary, reused when every input that shapes it is equal."""
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise TokenizerError("a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges, which this GGUF lacks")
        pre = _bpe_pre(meta)
        inputs: tuple[Any, ...] = (kind, pre, _digest(tokens), _digest(merges))
    else:
        scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(len(tokens))), dtype=np.float32)
        if scores.shape != (len(tokens),):
            raise TokenizerError(
                f"tokenizer.ggml.scores has {scores.size} entries for {len(tokens)} tokens; the GGUF is damaged"
            )
        unk = _optional_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
        inputs = (kind, add_space_prefix, unk, _digest(tokens), hashlib.sha256(scores.tobytes()).digest())
    key = hash(inputs)
    hit = _MODEL_CACHE.get(key)
    if hit is not None and hit[0] == inputs:
        _MODEL_CACHE.move_to_end(key)
        return hit[1]
    model: _FragmentModel
    if kind == "gpt2":
        model = ByteLevelBPE(tokens, merges, pre)
    else:
        model = SentencePieceBPE(
            tokens, scores, add_space_prefix=add_space_prefix, unk_id=0 if unk is None else unk
        )
    _MODEL_CACHE[key] = (inputs, model)
    while len(_MODEL_CACHE) > _CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return model


def _bpe_pre(meta: Mapping[str, Any]) -> str:
    """The BPE pre-tokenizer name; a vocabulary converted before the key existed gets llama.cpp's
    fallback, "default"."""
    return str(meta.get("tokenizer.ggml.pre", "default"))


def _digest(strings: Sequence[str]) -> bytes:
    """A content hash of a string list (the cache key holds this, not a copy of the vocabulary)."""
    if isinstance(strings, StringArray):
        return strings.digest()
    h = hashlib.sha256()
    for text in strings:
        raw = text.encode("utf-8", errors="surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()
