"""The two tiny Qwen models (qwen2 with q/k/v biases, qwen3 with per-head QK norms) that many
tests run fast, and llama.cpp's outputs for them, computed while the tests run.

Both models carry SmolLM2's real byte-level BPE vocabulary (49152 tokens, its merges and chat
template) under `tokenizer.ggml.pre = "qwen2"`, so llama.cpp splits text with the Qwen
pre-tokenizer; weights are seeded random F32 (no quantization: both engines use the same
numbers, so the references are exact). The text they generate is meaningless (greedy decoding
soon repeats a token); the numbers are what the tests compare.

Nothing here is stored: the models are written from the SmolLM2 test model's vocabulary, and
the references come from llama-cpp-python on those very files (tests skip without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from tests.llama_reference import GGML_TYPE_F16, GGML_TYPE_F32, LlamaF32, llama_tokenize

TINY_TAGS = ("tiny-qwen2", "tiny-qwen3")
N_LAYERS = 4
D_MODEL = 64
N_HEADS = 4
N_KV_HEADS = 2
FFN = 192
GREEDY_TOKENS = 16


@dataclass(frozen=True)
class TinyPrompt:
    """A prompt the references are computed for; `chat` ones go through the chat template."""

    name: str
    text: str
    chat: bool


# Strings whose llama.cpp tokenization the tests compare (no BOS, special tokens not parsed).
TOKENIZE_TEXTS = (
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces and\ttabs\nnew lines\n\n\ndone",
    "Numbers: 3.14159, 1,000,000 and 2026-11-29.",
    "def add(a, b):\n    return a + b\n",
    "把大模型装进口袋：家用设备集群推理。",
    "Emoji 🙂🚀 and accents: café, naïve, Größe.",
    "CamelCaseIdentifiers_and_snake_case_names",
    "<|im_start|>user literal special-looking text",
    "   ",
    "a",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
)
PROMPTS = (
    TinyPrompt("capital", "The capital of France is", chat=False),
    TinyPrompt("code", "# Python function that returns the n-th Fibonacci number\ndef fib(n):", chat=False),
    TinyPrompt("chat_zh", "请用一句话介绍你自己。", chat=True),
)

# The vocabulary's keys copied from the source model, as they are.
_VOCAB_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
)


def write_tiny_qwen(path: Path, arch: str, vocab_source: Path, seed: int) -> Path:
    """A 4-layer `arch` ("qwen2" or "qwen3") model with `vocab_source`'s vocabulary, seeded
    random F32 weights and a tied output head."""
    if arch not in ("qwen2", "qwen3"):
        raise ValueError(f"tiny Qwen models are qwen2 or qwen3, not {arch!r}")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(N_LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(D_MODEL)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    vocab_size = _copy_vocabulary(w, vocab_source)
    w.add_add_bos_token(False)
    head_dim = D_MODEL // N_HEADS

    def normal(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(shape)).astype(np.float32))

    normal("token_embd.weight", (vocab_size, D_MODEL), 1.0)
    normal("output_norm.weight", (D_MODEL,), 0.02, mean=1.0)
    matrix_std = D_MODEL**-0.5
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        normal(p + "attn_norm.weight", (D_MODEL,), 0.02, mean=1.0)
        normal(p + "attn_q.weight", (N_HEADS * head_dim, D_MODEL), matrix_std)
        normal(p + "attn_k.weight", (N_KV_HEADS * head_dim, D_MODEL), matrix_std)
        normal(p + "attn_v.weight", (N_KV_HEADS * head_dim, D_MODEL), matrix_std)
        if arch == "qwen2":
            normal(p + "attn_q.bias", (N_HEADS * head_dim,), 0.5)
            normal(p + "attn_k.bias", (N_KV_HEADS * head_dim,), 0.5)
            normal(p + "attn_v.bias", (N_KV_HEADS * head_dim,), 0.5)
        else:
            normal(p + "attn_q_norm.weight", (head_dim,), 0.02, mean=1.0)
            normal(p + "attn_k_norm.weight", (head_dim,), 0.02, mean=1.0)
        normal(p + "attn_output.weight", (D_MODEL, N_HEADS * head_dim), matrix_std)
        normal(p + "ffn_norm.weight", (D_MODEL,), 0.02, mean=1.0)
        normal(p + "ffn_gate.weight", (FFN, D_MODEL), matrix_std)
        normal(p + "ffn_up.weight", (FFN, D_MODEL), matrix_std)
        normal(p + "ffn_down.weight", (D_MODEL, FFN), FFN**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _copy_vocabulary(w: GGUFWriter, source: Path) -> int:
    """Copy the vocabulary keys of `source` into `w`; the number of tokens."""
    fields = GGUFReader(source).fields
    missing = [key for key in _VOCAB_KEYS if key not in fields]
    if missing:
        raise ValueError(f"{source} has no {', '.join(missing)}: not a model with a BPE vocabulary")
    for key in _VOCAB_KEYS:
        field = fields[key]
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    return len(fields["tokenizer.ggml.tokens"].data)


def llama_cpp_outputs(path: Path) -> dict[str, Any]:
    """llama.cpp's outputs for the tiny model at `path`: `tokenize` ({text, ids} of every
    TOKENIZE_TEXTS string) and `prompts`, one per PROMPTS entry with its `rendered` text,
    `prompt_token_ids` and two runs, `f32` (float32 KV cache) and `quant` (llama.cpp's default
    F16 KV cache), each with `logits` (the last prompt token's), `top5_ids` and
    `greedy_token_ids` (GREEDY_TOKENS of argmax decoding, stopping at an end-of-generation id)
    and their `greedy_text`."""
    tokenize = [
        {"text": text, "ids": ids}
        for text, ids in zip(TOKENIZE_TEXTS, llama_tokenize(path, TOKENIZE_TEXTS), strict=True)
    ]
    prompts: list[dict[str, Any]] = [{"name": p.name, "text": p.text, "chat": p.chat} for p in PROMPTS]
    for run, kv_type in (("f32", GGML_TYPE_F32), ("quant", GGML_TYPE_F16)):
        llm = LlamaF32(path, kv_type=kv_type)
        try:
            for prompt in prompts:
                rendered = llm.render_chat(prompt["text"]) if prompt["chat"] else prompt["text"]
                ids = llm.tokenize_prompt(rendered, add_bos=llm.adds_bos())
                logits, greedy = llm.last_logits_and_greedy(ids, GREEDY_TOKENS, llm.end_of_generation_ids())
                prompt.update(rendered=rendered, prompt_token_ids=ids)
                prompt[run] = {
                    "logits": logits,
                    "top5_ids": [int(i) for i in np.argsort(-logits)[:5]],
                    "greedy_token_ids": greedy,
                    "greedy_text": llm.detokenize(greedy),
                }
        finally:
            llm.close()
    return {"model": path.stem, "tokenize": tokenize, "prompts": prompts}
