"""Tensor shapes against the config, and config numbers against sane ranges: a file whose
metadata and tensors disagree is a ModelFileError naming the tensor or key, never a numpy error
later (or a kernel reading past a tensor's bytes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prima.errors import ModelFileError
from prima.model.config import config_from_metadata
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("geometry") / "tiny.gguf", arch="qwen2")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("qwen2.embedding_length", 32, "'token_embd.weight' has shape [323, 64]"),
        ("qwen2.feed_forward_length", 256, "'blk.0.ffn_gate.weight' has shape [128, 64]"),
        ("qwen2.attention.head_count_kv", 4, "'blk.0.attn_k.weight' has shape [32, 64]"),
        ("qwen2.attention.key_length", 8, "'blk.0.attn_q.weight' has shape [64, 64]"),
    ],
)
def test_a_tensor_that_disagrees_with_the_config_is_named(
    tiny_path: Path, key: str, value: int, words: str
) -> None:
    with GGUFFile(tiny_path) as gguf:
        ModelWeights(gguf).validate()  # as written, it is consistent
        gguf.metadata[key] = value
        with pytest.raises(ModelFileError, match=r"needs \[") as info:
            ModelWeights(gguf).validate()
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.attention.head_count", 0),
        ("llama.attention.head_count", "8"),
        ("llama.block_count", 2**40),
        ("llama.embedding_length", -1),
        ("llama.context_length", 0),
        ("llama.attention.layer_norm_rms_epsilon", float("nan")),
        ("llama.rope.freq_base", -1.0),
        ("llama.rope.dimension_count", 65),
    ],
)
def test_config_numbers_out_of_range_are_model_file_errors(key: str, value: Any) -> None:
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 128,
        key: value,
    }
    with pytest.raises(ModelFileError, match=key.split(".", 1)[1] if "dimension" not in key else "RoPE"):
        config_from_metadata(meta, vocab_size=100)
