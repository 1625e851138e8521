"""ModelConfig: the hyperparameters of a decoder-only transformer, read from GGUF metadata.

One frozen dataclass serves every supported architecture; the differences between them
(RoPE layout, QK norms, Gemma's extra norms and embedding scale, sliding-window layers) are
fields here, so the forward pass has a single code path.

Metadata comes from the file, so every number is checked for its type and a sane range before
it sizes anything: a corrupt head count is a ModelFileError naming the key, never a
ZeroDivisionError or a 2**40-element KV cache.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prima.errors import ModelFileError, UnsupportedModelError
from prima.kernels.ops_reference import ROPE_NEOX, ROPE_NORM

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
MAX_DIM = 1 << 20  # layers, widths, heads: far above any model, small enough that products fit memory
MAX_CONTEXT = 1 << 24

# RoPE layouts: ROPE_NORM, ROPE_NEOX (prima.kernels.ops_reference). GGUF llama models have q/k rows
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


def _int(
    meta: Mapping[str, Any], key: str, path: Path | str, default: int | None = None, high: int = MAX_DIM
) -> int:
    """A positive integer key (at most `high`); `default` if absent, required when it is None."""
    value = _need(meta, key, path) if default is None else meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= high:
        raise ModelFileError(
            f"{path}: metadata {key} is {value!r}; expected an integer in [1, {high}]: the file is corrupt"
        )
    return int(value)


def _float(meta: Mapping[str, Any], key: str, path: Path | str, default: float) -> float:
    """A positive finite float key, `default` if absent."""
    value = meta.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ModelFileError(
            f"{path}: metadata {key} is {value!r}; expected a positive number: the file is corrupt"
        )
    return float(value)


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
    n_layers = _int(meta, p + "block_count", path)
    d_model = _int(meta, p + "embedding_length", path)
    n_heads = _int(meta, p + "attention.head_count", path)
    n_kv_heads = _int(meta, p + "attention.head_count_kv", path, default=n_heads)
    if n_heads % n_kv_heads:
        raise ModelFileError(f"{path}: {n_heads} attention heads cannot share {n_kv_heads} KV heads")
    head_dim = _int(meta, p + "attention.key_length", path, default=max(d_model // n_heads, 1))
    rope_dim = _int(meta, p + "rope.dimension_count", path, default=head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise ModelFileError(
            f"{path}: RoPE over {rope_dim} of a head's {head_dim} dimensions; the file is corrupt"
        )
    if not 1 <= vocab_size <= 1 << 24:
        raise ModelFileError(f"{path}: a vocabulary of {vocab_size} tokens; the file is corrupt")
    common = dict(
        arch=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=_int(meta, p + "feed_forward_length", path),
        vocab_size=vocab_size,
        context_length=_int(meta, p + "context_length", path, default=2048, high=MAX_CONTEXT),
        norm_eps=_float(meta, p + "attention.layer_norm_rms_epsilon", path, 1e-5),
        rope_base=_float(meta, p + "rope.freq_base", path, 10000.0),
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
        sliding_window=_int(meta, p + "attention.sliding_window", path, default=MAX_CONTEXT, high=MAX_CONTEXT)
        if p + "attention.sliding_window" in meta
        else 0,
        swa_pattern=6,
        has_qk_norm=True,
        has_post_norms=True,
    )
