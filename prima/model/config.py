"""ModelConfig: the hyperparameters of a decoder-only transformer, read from GGUF metadata.

One frozen dataclass serves every supported architecture; the differences between them
(RoPE layout, QK norms, Gemma's extra norms and embedding scale, sliding-window layers) are
fields here, so the forward pass has a single code path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prima.errors import ModelFileError, UnsupportedModelError
from prima.kernels.ops import ROPE_NEOX, ROPE_NORM

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# RoPE layouts: ROPE_NORM, ROPE_NEOX (prima.kernels.ops). GGUF llama models have q/k rows
# permuted at conversion to use NORM.


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    rope_type: str
    activation: str  # "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    attn_scale: float
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(d_model)
    rope_base_local: float | None = None  # RoPE base on sliding-window layers (Gemma 3)
    sliding_window: int = 0  # 0: every layer attends to the whole context
    swa_pattern: int = 0  # every swa_pattern-th layer is global; others use the window
    has_qk_norm: bool = False
    has_post_norms: bool = False  # Gemma: norms after attention and after the FFN

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends only to the last `sliding_window` positions."""
        if not self.sliding_window or not self.swa_pattern:
            return False
        return (layer + 1) % self.swa_pattern != 0

    def layer_rope_base(self, layer: int) -> float:
        if self.is_sliding(layer) and self.rope_base_local is not None:
            return self.rope_base_local
        return self.rope_base


def _need(meta: Mapping[str, Any], key: str, path: Path | str) -> Any:
    if key not in meta:
        raise ModelFileError(f"{path}: metadata key {key!r} is missing; the GGUF file is incomplete")
    return meta[key]


def config_from_metadata(
    meta: Mapping[str, Any], vocab_size: int, path: Path | str = "<gguf>"
) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata; `vocab_size` is the embedding's row count."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch or '(none)'!r} is not supported; "
            f"prima runs: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    p = f"{arch}."
    n_layers = int(_need(meta, p + "block_count", path))
    d_model = int(_need(meta, p + "embedding_length", path))
    n_heads = int(_need(meta, p + "attention.head_count", path))
    n_kv_heads = int(meta.get(p + "attention.head_count_kv", n_heads))
    head_dim = int(meta.get(p + "attention.key_length", d_model // n_heads))
    if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ModelFileError(f"{path}: {n_heads} attention heads cannot share {n_kv_heads} KV heads")
    rope_dim = int(meta.get(p + "rope.dimension_count", head_dim))
    common = dict(
        arch=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int(_need(meta, p + "feed_forward_length", path)),
        vocab_size=vocab_size,
        context_length=int(meta.get(p + "context_length", 2048)),
        norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_dim=rope_dim,
        attn_scale=1.0 / math.sqrt(head_dim),
    )
    if arch == "llama":
        return ModelConfig(**common, rope_type=ROPE_NORM, activation="silu")
    if arch == "qwen2":
        return ModelConfig(**common, rope_type=ROPE_NEOX, activation="silu")
    if arch == "qwen3":
        return ModelConfig(**common, rope_type=ROPE_NEOX, activation="silu", has_qk_norm=True)
    # gemma3: GeGLU, QK norms, post-attention/FFN norms, scaled embeddings, and 5 of every 6
    # layers use a sliding window with a local RoPE base of 10000 (as llama.cpp's gemma3 graph).
    return ModelConfig(
        **common,
        rope_type=ROPE_NEOX,
        activation="gelu",
        embed_scale=math.sqrt(d_model),
        rope_base_local=10000.0,
        sliding_window=int(meta.get(p + "attention.sliding_window", 0)),
        swa_pattern=6,
        has_qk_norm=True,
        has_post_norms=True,
    )
