"""String arrays in GGUF metadata: decoded on access, equal to what gguf-py reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter

from prima.errors import ModelFileError
from prima.model.gguf_file import GGUFFile, StringArray
from prima.model.tokenizer import Tokenizer

WORDS = ["<s>", "", "héllo", "▁world", "日本語", "a b", "<0x0A>", "x" * 300]


def _write(path: Path, words: list[str]) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.words", words)
    w.add_string("test.after", "still here")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_string_array_equals_gguf_py(tmp_path: Path) -> None:
    path = _write(tmp_path / "words.gguf", WORDS)
    words = GGUFFile(path).metadata["test.words"]
    field = GGUFReader(path).fields["test.words"]
    reference = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert isinstance(words, StringArray)
    assert reference == WORDS
    assert list(words) == WORDS
    assert [words[i] for i in range(len(words))] == WORDS
    assert words == WORDS
    assert words[-1] == WORDS[-1]
    assert words[1:4] == WORDS[1:4]
    with pytest.raises(IndexError):
        words[len(WORDS)]


def test_string_array_membership_and_neighbours(tmp_path: Path) -> None:
    meta = GGUFFile(_write(tmp_path / "words.gguf", WORDS)).metadata
    words = meta["test.words"]
    assert "日本語" in words
    assert "" in words
    assert "hello" not in words
    assert 3 not in words
    assert meta["test.after"] == "still here"  # the cursor ends exactly after the array


def test_string_array_digest_follows_content(tmp_path: Path) -> None:
    a = GGUFFile(_write(tmp_path / "a.gguf", WORDS)).metadata["test.words"]
    b = GGUFFile(_write(tmp_path / "b.gguf", WORDS)).metadata["test.words"]
    c = GGUFFile(_write(tmp_path / "c.gguf", [*WORDS[:-1], "y"])).metadata["test.words"]
    assert a.digest() == b.digest()
    assert a == b
    assert a.digest() != c.digest()
    assert a != c


def test_string_array_truncated_names_the_problem(tmp_path: Path) -> None:
    data = _write(tmp_path / "words.gguf", WORDS).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"x" * 300) + 100])
    with pytest.raises(ModelFileError, match="truncated"):
        GGUFFile(cut)


def test_tokenizer_over_string_arrays_matches_lists(smollm2_path: Path) -> None:
    meta = GGUFFile(smollm2_path).metadata
    assert isinstance(meta["tokenizer.ggml.tokens"], StringArray)
    as_lists = {k: list(v) if isinstance(v, StringArray) else v for k, v in meta.items()}
    text = "Hello, world! Ünïcödé and numbers 12345 <|im_start|>"
    ours, plain = Tokenizer.from_gguf(meta), Tokenizer.from_gguf(as_lists)
    ids = ours.encode(text, parse_special=True)
    assert ids == plain.encode(text, parse_special=True)
    assert ours.decode(ids, special=True) == plain.decode(ids, special=True)
    assert ours.token_text(ids[0]) == plain.token_text(ids[0])
