"""Corrupt vocabularies from untrusted GGUF files: seeded damage to the tokenizer metadata of the
test models (token texts, merges, token types, scores, special ids, model and pre-tokenizer
names) either raises a PrimaError when the tokenizer is built, or gives a tokenizer that encodes
and decodes a set of strings without any other exception. Each case is bounded in count and
size (no token over MAX_TOKEN_CHARS, no text over a few hundred characters)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import TokenType

from prima.errors import PrimaError
from prima.model.gguf_file import GGUFFile
from prima.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # each case builds a vocabulary of 49k-262k tokens

SEED = 12
MAX_TOKEN_CHARS = 4096
TEXTS = (
    "Hello, world! The capital of France is Paris.",
    "  leading spaces and\ttabs\nnew lines  ",
    "日本語のテキスト, ελληνικά, русский 🙂",
    "<|im_start|>user\nhi<|im_end|><s></s><start_of_turn>",
    "\x00\x01 control \x7f and \u200b zero width",
    "1234567890 3.14159 -42",
    "a" * 300,
    "",
)
EDGE_INTS = (-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63))
ODD_STRINGS = ("", " ", "\x00", "\ud800", "<0xZZ>", "<0x>", "<0x100>", "a b c", "x" * MAX_TOKEN_CHARS, "▁")


def _meta(path: Path) -> dict[str, Any]:
    """The tokenizer keys of a model, as plain lists and arrays a case can change."""
    with GGUFFile(path) as gguf:
        meta = {k: v for k, v in gguf.metadata.items() if k.startswith("tokenizer.")}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key in meta:
            meta[key] = list(meta[key])
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta:
            meta[key] = np.array(meta[key])
    return meta


def _some(rng: random.Random, n: int, k: int = 8) -> list[int]:
    return [rng.randrange(n) for _ in range(min(k, n))]


def _damage_tokens(rng: random.Random, meta: dict[str, Any]) -> str:
    tokens = meta["tokenizer.ggml.tokens"]
    how = rng.choice(["odd", "duplicate", "truncate", "byte-tokens"])
    if how == "odd":
        for i in _some(rng, len(tokens)):
            tokens[i] = rng.choice(ODD_STRINGS)
    elif how == "duplicate":
        for i in _some(rng, len(tokens)):
            tokens[i] = tokens[rng.randrange(len(tokens))]
    elif how == "truncate":
        del tokens[rng.randrange(len(tokens)) :]
    else:
        for i in _some(rng, len(tokens)):
            tokens[i] = f"<0x{rng.randrange(512):02X}>"
    return f"tokens {how}"


def _damage_merges(rng: random.Random, meta: dict[str, Any]) -> str:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        meta["tokenizer.ggml.merges"] = [rng.choice(ODD_STRINGS)]
        return "merges added"
    how = rng.choice(["odd", "unknown-pieces", "truncate", "three-parts"])
    if how == "odd":
        for i in _some(rng, len(merges)):
            merges[i] = rng.choice(ODD_STRINGS)
    elif how == "unknown-pieces":
        for i in _some(rng, len(merges)):
            merges[i] = "qqqzz\u0101 \u0102zzq"
    elif how == "truncate":
        del merges[rng.randrange(len(merges)) :]
    else:
        for i in _some(rng, len(merges)):
            merges[i] = "a b c"
    return f"merges {how}"


def _damage_types(rng: random.Random, meta: dict[str, Any]) -> str:
    n = len(meta["tokenizer.ggml.tokens"])
    types = np.array(meta.get("tokenizer.ggml.token_type", np.full(n, TokenType.NORMAL)), dtype=np.int64)
    how = rng.choice(["out-of-range", "all-one-kind", "wrong-length", "some-kind"])
    if how == "out-of-range":
        for i in _some(rng, n):
            types[i] = rng.choice(EDGE_INTS)
    elif how == "all-one-kind":
        types[:] = rng.choice(list(TokenType))
    elif how == "wrong-length":
        types = types[: rng.randrange(n)]
    else:
        for i in _some(rng, n, 64):
            types[i] = rng.choice(list(TokenType))
    meta["tokenizer.ggml.token_type"] = types
    return f"token types {how}"


def _damage_scores(rng: random.Random, meta: dict[str, Any]) -> str:
    n = len(meta["tokenizer.ggml.tokens"])
    scores = np.array(meta.get("tokenizer.ggml.scores", np.zeros(n)), dtype=np.float32)  # as GGUF stores them
    how = rng.choice(["non-finite", "wrong-length", "huge"])
    if how == "non-finite":
        for i in _some(rng, n, 64):
            scores[i] = rng.choice([np.nan, np.inf, -np.inf])
    elif how == "wrong-length":
        scores = scores[: rng.randrange(n)]
    else:
        scores[:] = np.finfo(np.float32).max
    meta["tokenizer.ggml.scores"] = scores
    return f"scores {how}"


def _damage_ids(rng: random.Random, meta: dict[str, Any]) -> str:
    key = rng.choice(
        [
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id",
        ]
    )
    meta[key] = rng.choice([*EDGE_INTS, len(meta["tokenizer.ggml.tokens"]), float("nan"), "seven"])
    return f"{key} = {meta[key]!r}"


def _damage_names(rng: random.Random, meta: dict[str, Any]) -> str:
    key = rng.choice(["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"])
    meta[key] = rng.choice([*ODD_STRINGS[:4], "gpt2", "llama", "bert", 7, None])
    return f"{key} = {str(meta[key])[:20]!r}"


DAMAGES: tuple[Callable[[random.Random, dict[str, Any]], str], ...] = (
    _damage_tokens,
    _damage_merges,
    _damage_types,
    _damage_scores,
    _damage_ids,
    _damage_names,
)


def _cases(path: Path, n: int, seed: int) -> Iterator[tuple[str, dict[str, Any]]]:
    base = _meta(path)
    rng = random.Random(seed)
    for _ in range(n):
        meta = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in base.items()}
        what = [rng.choice(DAMAGES)(rng, meta) for _ in range(rng.choice([1, 1, 2]))]
        yield "; ".join(what), meta


def _exercise(tokenizer: Tokenizer) -> None:
    """Encode and decode every text, also one id at a time; only PrimaError may escape."""
    for text in TEXTS:
        for special in (False, True):
            try:
                ids = tokenizer.encode(text, parse_special=special)
            except PrimaError:
                continue
            try:
                tokenizer.decode(ids, special=special)
                stream = tokenizer.stream_decoder(special=special)
                for i in ids:
                    stream.feed(i)
                stream.flush()
            except PrimaError:
                continue


@pytest.mark.parametrize(("model", "n"), [("smollm2", 80), ("gemma3", 30)])
def test_corrupt_vocabularies_fail_cleanly_or_work(
    model: str, n: int, request: pytest.FixtureRequest
) -> None:
    """smollm2's byte-level BPE and gemma3's SentencePiece vocabulary (262k tokens: fewer cases)."""
    path = request.getfixturevalue(f"{model}_path")
    escaped = []
    outcomes = {"refused": 0, "works": 0}
    for i, (what, meta) in enumerate(_cases(path, n, SEED)):
        try:
            tokenizer = Tokenizer.from_gguf(meta)
        except PrimaError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # the finding this test exists to report
            escaped.append(f"case {i} ({what}) at load: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        try:
            _exercise(tokenizer)
            outcomes["works"] += 1
        except Exception as exc:  # as above
            escaped.append(f"case {i} ({what}) in use: {type(exc).__name__}: {str(exc)[:120]}")
    assert not escaped, "\n".join(escaped)
    # The damage reaches both outcomes.
    assert outcomes["refused"], outcomes
    assert outcomes["works"], outcomes
