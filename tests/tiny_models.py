"""Tiny GGUF models written with gguf-py's writer, for fast tests of loading and bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quant_shape_to_byte_shape, quantize


def write_tiny_model(
    path: Path,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 32,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    omit: tuple[str, ...] = (),
    seed: int = 0,
) -> Path:
    """A random-weight model of `arch` with a byte-level vocabulary of `vocab` tokens."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)]
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
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
