"""Every pre-tokenizer prima knows against llama.cpp's own tokenization of held-out strings.

The reference is computed while the test runs, by llama.cpp (llama-cpp-python) on a tensor-less
copy of the tiny-qwen2 oracle model whose `tokenizer.ggml.pre` is replaced: the same byte-level
vocabulary and merges, split by a different pre-tokenizer. None of these strings is in the shared
oracle. Skips when llama-cpp-python or the oracle directory is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.errors import TokenizerError
from prima.model.gguf_file import GGUFFile
from prima.model.pre_tokenizers import PRE_TOKENIZERS
from prima.model.tokenizer import Tokenizer
from tests.conftest import TINY_ORACLE_DIR, TINY_TAGS, tiny_model_path
from tests.llama_reference import copy_metadata, llama_tokenize

# Cases that separate the pre-tokenizers: digit runs of every length (single digits, groups of
# three, whole runs), contractions in both cases, letters of several scripts and cases, CJK and
# kana, emoji with joiners and modifiers, runs of spaces, tabs and newlines, non-ASCII spaces,
# combining marks, ASCII and full-width punctuation, and text that looks like special tokens.
HELD_OUT_TEXTS = (
    "Hello, world! 12345 don't DON'T We'LL ~~ a~b ~hello +~+",
    "Größe ÉCOLE aÉb ÀÉÎõü ΑΒΓ αβγ Ωmega CamelCase HTTPServer iPhone helloÉcole ÉCOLEécole",
    "  x\n\n  y\r\n\tz \n \n   ",
    "1 12 123 1234 12345 1234567 12,345.678 0.5e-10 ١٢٣ ²³ ½ Ⅻ",
    "把大模型装进口袋：家用设备集群推理。こんにちは、世界！カタカナ 한국어 텍스트 繁體中文",
    "emoji 🙂🚀👍🏽 👨‍👩‍👧 ❤️ 🇫🇷 ✓✗",
    "path/to/file.py:12 -> {\"a\": [1, 2]} <tag attr='x'>&amp;</tag> //comment /* c */",
    "tabs\t\tand\u00a0nbsp\u3000ideographic\u2009thin\u200bzero-width",
    "$100 + 5% = <=> ^_^ `code` |pipe| \\back ~x x~ ~~~a !~b ~\n~",
    "it's they're I've you'd she'll I'm 'S 'tis rock'n'roll O'Neil's",
    "Ｆｕｌｌ－ｗｉｄｔｈ　ＡＢＣ！（全角）",
    "naïve café résumé ñandú Straße İstanbul DŽungla ǅx",
    "\u0301combining e\u0301 a\u0308 ก่ะ",
    "...!!!???   ---=== ''' \"\"\" ```",
    "xxx   \n\n\n",
    "def f(x):\n\tif x > 10:\n\t\treturn x ** 2  # square\n\n\n    pass\n",
    "<|im_start|>system\n<|im_end|> <s></s> [INST] <<SYS>>",
    "Ünïcödé ÜBER über العربية ١٢ עברית русский Русский",
    "     ",
    "\n",
    " a",
    "a  b   c    d",
)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not TINY_ORACLE_DIR.is_dir():
        pytest.skip(f"no tiny oracle at {TINY_ORACLE_DIR}")
    return tmp_path_factory.mktemp("vocab")


def _prima_ids(path: Path, texts: tuple[str, ...]) -> list[list[int]]:
    with GGUFFile(path) as gguf:
        tok = Tokenizer.from_gguf(gguf.metadata)
    return [tok.encode(t) for t in texts]


def _assert_same(path: Path) -> None:
    expected = llama_tokenize(path, HELD_OUT_TEXTS)
    got = _prima_ids(path, HELD_OUT_TEXTS)
    for text, want, have in zip(HELD_OUT_TEXTS, expected, got, strict=True):
        assert have == want, f"{text!r}"


# "gpt2" is not a name llama.cpp accepts; it is prima's older spelling of "gpt-2", checked below.
LLAMA_CPP_NAMES = sorted(set(PRE_TOKENIZERS) - {"gpt2"})


@pytest.mark.parametrize("pre", LLAMA_CPP_NAMES)
def test_pre_tokenizer_matches_llama_cpp(vocab_dir: Path, pre: str) -> None:
    _assert_same(
        copy_metadata(tiny_model_path("tiny-qwen2"), vocab_dir / f"{pre}.gguf", {"tokenizer.ggml.pre": pre})
    )


def test_gpt2_is_gpt_2() -> None:
    assert PRE_TOKENIZERS["gpt2"] == PRE_TOKENIZERS["gpt-2"]


@pytest.mark.parametrize("tag", TINY_TAGS)
def test_tiny_models_tokenize_held_out_like_llama_cpp(tag: str) -> None:
    if not TINY_ORACLE_DIR.is_dir():
        pytest.skip(f"no tiny oracle at {TINY_ORACLE_DIR}")
    _assert_same(tiny_model_path(tag))


def test_missing_pre_is_llama_cpp_default(vocab_dir: Path) -> None:
    _assert_same(
        copy_metadata(tiny_model_path("tiny-qwen2"), vocab_dir / "nopre.gguf", drop=("tokenizer.ggml.pre",))
    )


def test_unknown_pre_tokenizer_names_supported_ones() -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "no-such-pre",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(TokenizerError, match=r"'no-such-pre'.*deepseek-v3.*llama-bpe.*qwen2.*tekken"):
        Tokenizer.from_gguf(meta)
