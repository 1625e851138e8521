"""The pre-tokenizers of byte-level BPE vocabularies, by their GGUF name (`tokenizer.ggml.pre`).

Before merging, llama.cpp splits text into words with a list of regexes chosen by the vocabulary's
`pre` name (llama-vocab.cpp, the `LLAMA_VOCAB_PRE_TYPE_*` switch); each regex splits every piece the
previous one left, and a piece never merges across a split. The patterns below are llama.cpp's, in
the syntax of the `regex` module that runs them (Oniguruma's too), where a piece is split on its
own exactly as in llama.cpp's `unicode_regex_split`. Each name here is checked against
llama.cpp's own tokenization in tests/model/test_pre_tokenizers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from prima.errors import TokenizerError


@dataclass(frozen=True)
class PreTokenizer:
    """How one family of vocabularies is split before BPE.

    `ignore_merges`: a word that is itself in the vocabulary becomes that token without merging
    (llama.cpp sets this for Llama 3 and Tekken vocabularies, as their HF tokenizers do).
    `add_bos`: whether prompts start with BOS when the GGUF has no `tokenizer.ggml.add_bos_token`.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# GPT-2: contractions, letter runs, digit runs, other runs, each with one leading space.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _cl100k(numbers: str) -> str:
    """The GPT-4 (cl100k) layout Llama 3 and Qwen 2 share; they differ in how digits group."""
    return (
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|"
        + numbers
        + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


# GPT-4o / Tekken split a word before each capital. llama.cpp's regex engine sees every non-ASCII
# letter as one placeholder character, so it cannot tell case outside ASCII: it spells "upper" as
# "a letter but not a-z" and "lower" as "a letter but not A-Z", and so do we ("xÉcole" is one word
# to llama.cpp, two to Unicode; the held-out strings of the test include such cases).
_UPPER = r"(?:(?=\p{L})[^a-z])"
_LOWER = r"(?:(?=\p{L})[^A-Z])"


def _cased_words(contractions: str) -> str:
    return (
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{contractions}"
        rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{contractions}"
    )


_TAIL_SLASH = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# DeepSeek LLM (v1): the cased letters of many scripts, ASCII and full-width punctuation,
# CJK and Hangul runs, digit runs.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3"
    "-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90"
    "-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20"
    "-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc"
    "\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6"
    "-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-"
    "\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-"
    "\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70"
    "-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0"
    "-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
# Escapes, not literal characters: an editor's Unicode normalization would silently change ranges.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_V3_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"

_DEEPSEEK_V3 = PreTokenizer(
    (
        r"\p{N}{1,3}",
        _DEEPSEEK_V3_CJK,
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
        r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )
)
# BLOOM-style: a word is a run of anything but whitespace and a few punctuation marks (the pattern
# is llama.cpp's, where "(", "|" and ")" inside the class are literal characters too).
_BLOOM = PreTokenizer((" ?[^(\\s|.,!?…。，、।۔،)]+",))

_GPT4O = PreTokenizer((_cased_words(_CONTRACTIONS + "?") + r"|\p{N}{1,3}" + _TAIL_SLASH,))
_GPT2_STYLE = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3 = PreTokenizer((_cl100k(r"\p{N}{1,3}"),), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((_cl100k(r"\p{N}"),))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback for BPE vocabularies converted before `pre` existed.
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    # GPT-2 and the vocabularies converted from it ("gpt2" is prima's older spelling of "gpt-2").
    "gpt2": _GPT2_STYLE,
    "gpt-2": _GPT2_STYLE,
    "phi-2": _GPT2_STYLE,
    "mpt": _GPT2_STYLE,
    "olmo": _GPT2_STYLE,
    "jais": _GPT2_STYLE,
    "trillion": _GPT2_STYLE,
    "exaone4": _GPT2_STYLE,
    "mellum": _GPT2_STYLE,
    "granite-docling": _GPT2_STYLE,
    "a.x-4.0": _GPT2_STYLE,
    "gigachat": _GPT2_STYLE,
    # The same after cutting every digit apart.
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    # Llama 3 (and models that ship its tokenizer): digits in groups of up to three.
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3,
    "midm-2.0": _LLAMA3,
    "lfm2": _LLAMA3,
    "glm4": PreTokenizer(_LLAMA3.regexes, ignore_merges=True),
    "dbrx": PreTokenizer(_LLAMA3.regexes),
    "smaug-bpe": PreTokenizer(_LLAMA3.regexes),
    "chatglm-bpe": PreTokenizer(_LLAMA3.regexes),
    # Qwen 2 / 2.5 / 3 and their distillations: single digits.
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "stablelm2": _QWEN2,
    "megrez": _QWEN2,
    "hunyuan": _QWEN2,
    # Ling / LLaDA-MoE: llama.cpp spells their pattern differently (one newline at a time,
    # contractions grouped); it splits text the same way.
    "bailingmoe": _QWEN2,
    "llada-moe": _QWEN2,
    # Qwen 3.5: combining marks stay inside words.
    "qwen35": PreTokenizer(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "seed-coder": PreTokenizer(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "deepseek-llm": PreTokenizer(
        ("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+$", _DEEPSEEK_CJK, r"\p{N}+")
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")),
    "deepseek-v3": _DEEPSEEK_V3,
    "hunyuan-dense": _DEEPSEEK_V3,
    "joyai-llm": _DEEPSEEK_V3,
    "bloom": _BLOOM,
    "poro-chat": _BLOOM,
    "gpt3-finnish": _BLOOM,
    "viking": PreTokenizer((*_BLOOM.regexes, r"\p{N}")),
    "tekken": PreTokenizer((_cased_words("") + r"|\p{N}" + _TAIL_SLASH,), ignore_merges=True, add_bos=True),
    "gpt-4o": _GPT4O,
    "llama4": _GPT4O,
}


def pre_tokenizer(name: str) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` name; TokenizerError names the known ones."""
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        raise TokenizerError(
            f"unsupported BPE pre-tokenizer {name!r} (tokenizer.ggml.pre); prima supports: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        ) from None
