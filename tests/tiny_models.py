"""Tiny GGUF models written with gguf-py's writer: fast tests of loading and bad input, and
random-weight models of every architecture that `load_model` runs end to end (and llama.cpp
loads too, so tests can compare the two without downloading anything)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quant_shape_to_byte_shape, quantize

from prima.model.tokenizer_bpe import bytes_to_unicode

# Control tokens first, as in SmolLM2's vocabulary: ids 0, 1, 2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What the default vocabulary learns its merges from: a little prose, code, digits and CJK.
DEFAULT_CORPUS = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. ",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "把大模型装进口袋，家用设备集群推理。",
    "It's 2026; they're testing tokenizers, aren't they?",
)


def byte_level_vocab(corpus: Sequence[str], n_merges: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, then the tokens of up to `n_merges`
    merges learned from `corpus` (most frequent adjacent pair first, ties to the smaller pair).
    Nothing splits the corpus before learning, so merged tokens cross word, digit and case
    boundaries: how a pre-tokenizer splits text shows in the ids."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    words = [[table[b] for b in text.encode("utf-8")] for text in corpus]
    merges: list[str] = []
    known = set(tokens)
    while len(merges) < n_merges:
        pairs = Counter(p for w in words for p in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (left, right), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(f"{left} {right}")
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)
        words = [_merge(w, left, right) for w in words]
    return tokens, merges


def _merge(word: list[str], left: str, right: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def add_vocab(
    w: GGUFWriter,
    *,
    corpus: Sequence[str] = DEFAULT_CORPUS,
    n_merges: int = 64,
    pre: str | None = "qwen2",
    chat_template: str | None = CHATML_TEMPLATE,
    whole_words: Sequence[str] = (),
    add_bos: bool | None = False,
) -> int:
    """Write a byte-level BPE vocabulary (`byte_level_vocab` behind the control tokens) and
    return its size. `whole_words` become tokens no merge leads to (what `ignore_merges` finds).
    `pre=None` / `add_bos=None` leave the key out, as in files converted before it existed."""
    normal, merges = byte_level_vocab(corpus, n_merges)
    table = bytes_to_unicode()
    normal += ["".join(table[b] for b in word.encode("utf-8")) for word in whole_words]
    # A corpus holding "<|im_end|>" as text learns it as a token; the vocabulary has each token once.
    normal = [t for t in dict.fromkeys(normal) if t not in SPECIAL_TOKENS]
    tokens = [*SPECIAL_TOKENS, *normal]
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL] * len(SPECIAL_TOKENS) + [TokenType.NORMAL] * len(normal))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return len(tokens)


def write_vocab_only(path: Path, **vocab: object) -> Path:
    """A tensor-less qwen2 GGUF holding only a vocabulary (`add_vocab`'s arguments), which both
    prima's Tokenizer and llama.cpp's `vocab_only` load."""
    w = GGUFWriter(str(path), "qwen2")
    _add_hparams(w, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn=128)
    add_vocab(w, **vocab)  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_hparams(
    w: GGUFWriter, *, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, ffn: int
) -> None:
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)


def write_tiny_model(
    path: Path,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    omit: tuple[str, ...] = (),
    seed: int = 0,
    pre: str | None = "qwen2",
    chat_template: str | None = CHATML_TEMPLATE,
    block_count: int | None = None,
) -> Path:
    """A random-weight model of `arch` with a small byte-level BPE vocabulary (`add_vocab`);
    `block_count` claims another number of layers than the file holds (a corrupt header)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    claimed = n_layers if block_count is None else block_count
    _add_hparams(w, n_layers=claimed, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn=ffn)
    if arch == "gemma3":
        w.add_sliding_window(16)  # every layer but each sixth attends to the last 16 positions
    vocab = add_vocab(w, pre=pre, chat_template=chat_template)
    head_dim = d_model // n_heads

    def add(name: str, shape: tuple[int, ...], quantized: bool = True) -> None:
        if name in omit:
            return
        data = rng.standard_normal(shape).astype(np.float32) * 0.2
        if quantized and qtype != GGMLQuantizationType.F32 and len(shape) == 2:
            try:
                blocks = quantize(data, qtype)
            except NotImplementedError:  # gguf-py cannot quantize every type; random blocks will do
                blocks = rng.integers(0, 256, quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
            w.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            if len(shape) == 1:
                data = 1.0 + data * 0.1
            w.add_tensor(name, data)

    add("token_embd.weight", (vocab, d_model))
    add("output_norm.weight", (d_model,))
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (d_model,))
        add(p + "attn_q.weight", (n_heads * head_dim, d_model))
        add(p + "attn_k.weight", (n_kv_heads * head_dim, d_model))
        add(p + "attn_v.weight", (n_kv_heads * head_dim, d_model))
        add(p + "attn_output.weight", (d_model, n_heads * head_dim))
        add(p + "ffn_norm.weight", (d_model,))
        add(p + "ffn_gate.weight", (ffn, d_model))
        add(p + "ffn_up.weight", (ffn, d_model))
        add(p + "ffn_down.weight", (d_model, ffn))
        if arch == "qwen2":
            add(p + "attn_q.bias", (n_heads * head_dim,), quantized=False)
            add(p + "attn_k.bias", (n_kv_heads * head_dim,), quantized=False)
            add(p + "attn_v.bias", (n_kv_heads * head_dim,), quantized=False)
        if arch in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", (head_dim,))
            add(p + "attn_k_norm.weight", (head_dim,))
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", (d_model,))
            add(p + "post_ffw_norm.weight", (d_model,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
