"""TokenIndex: the same answers as a dict {text: id} over the vocabulary, in a few arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.model import token_index
from prima.model.gguf_file import GGUFFile
from prima.model.token_index import TokenIndex


def test_lookup_equals_a_dict_and_later_duplicates_win() -> None:
    tokens = ["a", "b", "ab", "a", "", "▁the", "b"]
    index = TokenIndex(tokens)
    as_dict = {t: i for i, t in enumerate(tokens)}
    for text in [*tokens, "abc", "c", "▁", "the"]:
        assert index.get(text) == as_dict.get(text)


def test_a_hash_collision_never_matches_the_wrong_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_index, "hash", lambda text: 7, raising=False)  # every text collides
    index = TokenIndex(["x", "y", "z", "y"])
    assert [index.get(t) for t in ("x", "y", "z", "w")] == [0, 3, 2, None]


def test_gemma_vocabulary_indexed_without_a_str_per_token(gemma3_path: Path) -> None:
    with GGUFFile(gemma3_path) as gguf:
        tokens = gguf.metadata["tokenizer.ggml.tokens"]
        index = TokenIndex(tokens)
        arrays = [v for v in vars(index).values() if isinstance(v, np.ndarray)]
        assert sum(a.nbytes for a in arrays) == 12 * len(tokens)  # 8-byte hash and 4-byte id each
        assert index._tokens is tokens  # texts are read from the mapped header, not copied
        as_dict = {t: i for i, t in enumerate(tokens)}
        for text in (tokens[i] for i in range(0, len(tokens), 97)):
            assert index.get(text) == as_dict[text]


def test_earlier_duplicates_win_when_asked() -> None:
    merges = ["a b", "ab c", "a b", "x y"]
    index = TokenIndex(merges, later_duplicates_win=False)
    assert [index.get(m) for m in ("a b", "ab c", "x y", "b c")] == [0, 1, 3, None]
