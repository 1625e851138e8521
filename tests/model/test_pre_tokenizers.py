"""Every pre-tokenizer prima knows against llama.cpp's own tokenization of held-out strings.

The reference is computed while the test runs, by llama.cpp (llama-cpp-python) reading the same
file with `tokenizer.ggml.pre` overridden: the same vocabulary and merges, split by another
pre-tokenizer. Two vocabularies: tiny-qwen2's (SmolLM2's real 49152 tokens), and
a small one learned from the test strings with nothing split first (tests/tiny_models.py), whose
tokens cross word, digit, case and script boundaries, so a split in the wrong place changes the
ids (SmolLM2's vocabulary, for one, has no multi-digit tokens to show how digits group). None of
these strings is in tests/data/llama_cpp. Skips when llama-cpp-python is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.errors import TokenizerError
from prima.model.gguf_file import GGUFFile
from prima.model.pre_tokenizers import PRE_TOKENIZERS
from prima.model.tokenizer import Tokenizer
from tests.conftest import tiny_model_path
from tests.llama_reference import llama_tokenize
from tests.tiny_models import write_vocab_only
from tests.tiny_qwen import TINY_TAGS

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
    # Repeated, so that the learned vocabulary has tokens across the boundaries that separate
    # the pre-tokenizers: lower case into a non-ASCII capital, combining marks, newline runs,
    # punctuation before a newline, contractions running on into letters.
    "xÉcole xÉcole xÉcole motÀmot motÀmot motÀmot σΣσ σΣσ σΣσ",
    "cafe\u0301s cafe\u0301s cafe\u0301s x\u0308\u0301y x\u0308\u0301y",
    "x\n\n\ny x\n\n\ny x\n\n\ny x \n \n y x \n \n y",
    "end.\n\nend.\n\nend.\n\n (a)\n(a)\n(a)\n",
    "we'llbe we'llbe we'llbe don'tx don'tx don'tx I'MOK I'MOK",
    # In the vocabulary as a whole word that no merge reaches: split apart unless ignore_merges.
    "Zyzzyvas",
)
WHOLE_WORDS = ("Zyzzyvas",)


@pytest.fixture(scope="module")
def learned_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab_only(
        tmp_path_factory.mktemp("vocab") / "learned.gguf",
        corpus=[t for t in HELD_OUT_TEXTS if t not in WHOLE_WORDS],
        n_merges=800,
        pre="qwen2",
        whole_words=WHOLE_WORDS,
    )


def _assert_same(path: Path, pre: str | None = None) -> None:
    """prima and llama.cpp give the same ids for every held-out text, with `pre` (if given)
    in place of the file's `tokenizer.ggml.pre`."""
    overrides = {"tokenizer.ggml.pre": pre} if pre is not None else None
    expected = llama_tokenize(path, HELD_OUT_TEXTS, overrides)
    with GGUFFile(path) as gguf:
        tok = Tokenizer.from_gguf({**gguf.metadata, **(overrides or {})})
    for text, want in zip(HELD_OUT_TEXTS, expected, strict=True):
        assert tok.encode(text) == want, f"{text!r}"


# "gpt2" is not a name llama.cpp accepts; it is prima's older spelling of "gpt-2", checked below.
LLAMA_CPP_NAMES = sorted(set(PRE_TOKENIZERS) - {"gpt2"})


@pytest.mark.parametrize("pre", LLAMA_CPP_NAMES)
def test_pre_tokenizer_matches_llama_cpp_on_learned_vocab(learned_vocab: Path, pre: str) -> None:
    _assert_same(learned_vocab, pre)


@pytest.mark.parametrize("pre", LLAMA_CPP_NAMES)
def test_pre_tokenizer_matches_llama_cpp_on_real_vocab(pre: str) -> None:
    _assert_same(tiny_model_path("tiny-qwen2"), pre)


def test_learned_vocab_tells_pre_tokenizers_apart(learned_vocab: Path) -> None:
    """The learned vocabulary makes the check above mean something: pre-tokenizers that differ
    (in their patterns or in ignore_merges) tokenize the held-out strings differently. Not all
    differences show: Qwen 2's pattern and its variant without contractions, for one, agree here."""
    with GGUFFile(learned_vocab) as gguf:
        meta = dict(gguf.metadata)
    seen: dict[tuple[tuple[int, ...], ...], str] = {}
    for pre in (
        "default",
        "gpt-2",
        "smollm",
        "llama-bpe",
        "qwen2",
        "deepseek-llm",
        "deepseek-coder",
        "deepseek-v3",
        "tekken",
        "gpt-4o",
        "dbrx",  # llama-bpe's pattern without ignore_merges
        "qwen35",
        "seed-coder",
        "bloom",
        "viking",
    ):
        tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": pre})
        ids = tuple(tuple(tok.encode(t)) for t in HELD_OUT_TEXTS)
        assert ids not in seen, f"{pre} tokenizes like {seen.get(ids)}"
        seen[ids] = pre


@pytest.mark.parametrize("pre", LLAMA_CPP_NAMES)
def test_bos_default_matches_llama_cpp(tmp_path: Path, pre: str) -> None:
    """Without `tokenizer.ggml.add_bos_token`, BOS is added as llama.cpp adds it for this `pre`."""
    path = write_vocab_only(tmp_path / "nobos.gguf", pre=pre, add_bos=None)
    (expected,) = llama_tokenize(path, ["Hello"], add_bos=True)
    with GGUFFile(path) as gguf:
        tok = Tokenizer.from_gguf(gguf.metadata)
    assert tok.encode("Hello", add_bos=tok.add_bos_default) == expected


def test_gpt2_is_gpt_2() -> None:
    assert PRE_TOKENIZERS["gpt2"] == PRE_TOKENIZERS["gpt-2"]


@pytest.mark.parametrize("tag", TINY_TAGS)
def test_tiny_models_tokenize_held_out_like_llama_cpp(tag: str) -> None:
    _assert_same(tiny_model_path(tag))


def test_missing_pre_is_llama_cpp_default(tmp_path: Path) -> None:
    _assert_same(write_vocab_only(tmp_path / "nopre.gguf", corpus=HELD_OUT_TEXTS, n_merges=800, pre=None))


def test_unknown_pre_tokenizer_names_supported_ones() -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "no-such-pre",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(TokenizerError, match=r"'no-such-pre'.*deepseek-v3.*llama-bpe.*qwen2.*tekken"):
        Tokenizer.from_gguf(meta)
