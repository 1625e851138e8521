"""Tokenizer: equality with llama.cpp on both test models, plus the SPM merge rules on a tiny vocab."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import TokenType

from prima.errors import TokenizerError
from prima.model.gguf_file import GGUFFile
from prima.model.tokenizer import Tokenizer
from tests.conftest import run_python


@pytest.fixture(scope="module")
def tokenizers(smollm2_path: Path, gemma3_path: Path) -> dict[str, Tokenizer]:
    out = {}
    for tag, path in (("smollm2-135m", smollm2_path), ("gemma3-270m", gemma3_path)):
        with GGUFFile(path) as gguf:
            out[tag] = Tokenizer.from_gguf(gguf.metadata)
    return out


def test_encode_matches_llama_cpp(tokenizers: dict[str, Tokenizer], oracle_tokenize_case: tuple) -> None:
    tag, text, ids = oracle_tokenize_case
    assert tokenizers[tag].encode(text) == ids


def test_prompt_tokens_match_llama_cpp(tokenizers: dict[str, Tokenizer], oracle_prompt_case: tuple) -> None:
    tag, prompt = oracle_prompt_case
    tok = tokenizers[tag]
    assert (
        tok.encode(prompt["rendered"], add_bos=tok.add_bos_default, parse_special=True)
        == prompt["prompt_token_ids"]
    )


def test_decode_round_trips_oracle_text(
    tokenizers: dict[str, Tokenizer], oracle_tokenize_case: tuple
) -> None:
    tag, text, ids = oracle_tokenize_case
    assert tokenizers[tag].decode(ids) == text


def test_special_ids_from_metadata(tokenizers: dict[str, Tokenizer]) -> None:
    smol, gemma = tokenizers["smollm2-135m"], tokenizers["gemma3-270m"]
    assert (smol.bos_id, smol.eos_id, smol.add_bos_default, smol.vocab_size) == (1, 2, False, 49152)
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos_default, gemma.vocab_size) == (2, 1, True, 262144)
    assert smol.token_text(2) == "<|im_end|>"
    assert 2 in smol.stop_ids
    assert gemma.token_text(106) == "<end_of_turn>"
    assert {1, 106} <= gemma.stop_ids


@pytest.mark.parametrize(
    ("tag", "special"), [("smollm2-135m", "<|im_start|>"), ("gemma3-270m", "<start_of_turn>")]
)
def test_parse_special_makes_control_text_one_token(
    tokenizers: dict[str, Tokenizer], tag: str, special: str
) -> None:
    tok = tokenizers[tag]
    parsed = tok.encode(f"{special}user", parse_special=True)
    assert tok.token_text(parsed[0]) == special
    assert len(tok.encode(special)) > 1  # without parse_special it is ordinary text


def test_add_bos_prepends_bos(tokenizers: dict[str, Tokenizer]) -> None:
    gemma = tokenizers["gemma3-270m"]
    assert gemma.encode("a", add_bos=True) == [gemma.bos_id, *gemma.encode("a")]


def test_decode_hides_control_tokens_unless_special(tokenizers: dict[str, Tokenizer]) -> None:
    smol = tokenizers["smollm2-135m"]
    ids = smol.encode("<|im_start|>hi<|im_end|>", parse_special=True)
    assert smol.decode(ids) == "hi"
    assert smol.decode(ids, special=True) == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("tag", ["smollm2-135m", "gemma3-270m"])
def test_stream_decoder_emits_only_complete_characters(tokenizers: dict[str, Tokenizer], tag: str) -> None:
    tok = tokenizers[tag]
    text = "把大模型装进口袋 🙂🚀 Größe"
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    chunks = [stream.feed(i) for i in ids]
    assert "".join(chunks) + stream.flush() == text
    assert all("\ufffd" not in c for c in chunks)


def test_stream_decoder_holds_character_split_across_tokens(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["smollm2-135m"]
    ids = tok.encode("把")  # one character, three byte-level tokens
    stream = tok.stream_decoder()
    assert len(ids) > 1
    assert [stream.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["把"]


def test_stream_decoder_flush_marks_incomplete_character(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["gemma3-270m"]
    lead_byte = next(
        i for i in range(tok.vocab_size) if tok.token_text(i) == "<0xF0>"
    )  # starts a 4-byte char
    stream = tok.stream_decoder()
    assert stream.feed(lead_byte) == ""
    assert stream.flush() == "\ufffd"


def test_unsupported_model_names_supported_ones() -> None:
    with pytest.raises(TokenizerError, match=r"'bert'.*gpt2.*llama"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_token_id_out_of_range_is_an_error(tokenizers: dict[str, Tokenizer]) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizers["smollm2-135m"].token_text(10**6)


# -- SPM merge rules on a tiny vocabulary -----------------------------------------------------------


def _spm_meta(
    pieces: dict[str, float], *, add_space_prefix: bool = False, user_defined: tuple[str, ...] = ()
) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *user_defined]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    types += [TokenType.NORMAL] * len(pieces) + [TokenType.USER_DEFINED] * len(user_defined)
    scores = [0.0] * 259 + list(pieces.values()) + [0.0] * len(user_defined)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def _texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_spm_merges_highest_score_pair_first() -> None:
    base = {"a": -1.0, "b": -1.0, "c": -1.0}
    left_wins = Tokenizer.from_gguf(_spm_meta({**base, "ab": -2.0, "bc": -3.0}))
    right_wins = Tokenizer.from_gguf(_spm_meta({**base, "ab": -3.0, "bc": -2.0}))
    assert _texts(left_wins, left_wins.encode("abc")) == ["ab", "c"]
    assert _texts(right_wins, right_wins.encode("abc")) == ["a", "bc"]


def test_spm_equal_scores_merge_leftmost_pair() -> None:
    tok = Tokenizer.from_gguf(_spm_meta({"a": -1.0, "aa": -2.0}))
    assert _texts(tok, tok.encode("aaa")) == ["aa", "a"]


def test_spm_is_greedy_not_viterbi() -> None:
    # Viterbi would pick "a"+"bcd" (-2 -2); greedy merging takes "ab" (best pair) and is stuck with it.
    tok = Tokenizer.from_gguf(
        _spm_meta(
            {"a": -2.0, "b": -9.0, "c": -9.0, "d": -9.0, "ab": -1.0, "bc": -5.0, "bcd": -2.0, "cd": -8.0}
        )
    )
    assert _texts(tok, tok.encode("abcd")) == ["ab", "cd"]


def test_spm_falls_back_to_utf8_bytes() -> None:
    tok = Tokenizer.from_gguf(_spm_meta({"a": -1.0}))
    assert _texts(tok, tok.encode("aé")) == ["a", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("aé")) == "aé"


def test_spm_space_prefix_and_space_marker() -> None:
    tok = Tokenizer.from_gguf(_spm_meta({"\u2581": -1.0, "a": -1.0, "\u2581a": -0.5}, add_space_prefix=True))
    assert _texts(tok, tok.encode("a a")) == ["\u2581a", "\u2581a"]
    assert tok.decode(tok.encode("a a")) == "a a"  # the added prefix space is removed again


def test_spm_user_defined_tokens_split_out_without_parse_special() -> None:
    tok = Tokenizer.from_gguf(_spm_meta({"a": -1.0, "b": -1.0}, user_defined=("\n", "\n\n")))
    assert _texts(tok, tok.encode("a\n\n\nb")) == ["a", "\n\n", "\n", "b"]


# -- memory: the vocabulary stays in the mapped GGUF ------------------------------------------------

HELD_IN_PROCESS = """
import sys
from prima.model.files import open_model

for name in sys.argv[1:]:
    tok = open_model(name, layers=range(0)).tokenizer
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"
print(sorted(m for m in ("tokenizers", "sentencepiece") if m in sys.modules))
"""


def test_tokenizers_build_without_hf_tokenizers(smollm2_path: Path, gemma3_path: Path) -> None:
    """Both vocabularies index the GGUF's own strings (prima.model.token_index); HF's library
    (its string maps and ~5 MiB of code resident) is never loaded."""
    done = run_python(HELD_IN_PROCESS, str(smollm2_path), str(gemma3_path), timeout=300)
    assert done.stdout.strip() == "[]"
