"""llama.cpp itself (through llama-cpp-python) as a reference computed while the tests run.

The shared oracle holds llama.cpp's outputs for fixed strings and prompts; these helpers produce
the same kind of reference for strings, prompts and files the oracle does not have (held-out
cases, other `tokenizer.ggml.pre` values, tiny models written by tests/tiny_models.py). Tests that use them skip
with the reason when llama-cpp-python is not installed (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

GGML_TYPE_F32 = 0  # ggml_type: an F32 KV cache, as the oracle's `f32` runs use
GGML_TYPE_F16 = 1  # llama.cpp's default KV cache, which prima's q8 mode keeps too


def require_llama_cpp() -> ModuleType:
    """The llama_cpp module, or skip the calling test with the reason."""
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed; it computes the reference for this test"
    )


def llama_tokenize(
    path: Path, texts: Sequence[str], overrides: dict[str, str] | None = None, *, add_bos: bool = False
) -> list[list[int]]:
    """llama.cpp's ids for each text, special tokens not parsed; no BOS (as the oracle's
    `tokenize`), or with `add_bos` BOS where the vocabulary says so. `overrides` replaces string
    metadata as the file is read (llama.cpp's `--override-kv`), e.g. another `tokenizer.ggml.pre`."""
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, kv_overrides=overrides, verbose=False)
    try:
        return [llm.tokenize(t.encode("utf-8"), add_bos=add_bos, special=False) for t in texts]
    finally:
        llm.close()


class LlamaF32:
    """A model in llama.cpp with the oracle's `f32` settings: F32 KV cache (or `kv_type`), no
    flash attention."""

    def __init__(self, path: Path, n_ctx: int = 512, kv_type: int = GGML_TYPE_F32) -> None:
        llama_cpp = require_llama_cpp()
        self._llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=2,
            logits_all=True,
            type_k=kv_type,
            type_v=kv_type,
            flash_attn=False,
            verbose=False,
        )

    def tokenize_prompt(self, text: str, add_bos: bool) -> list[int]:
        """Prompt ids with special tokens parsed, as the oracle's `prompt_token_ids`."""
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def last_logits_and_greedy(
        self, prompt_ids: Sequence[int], max_tokens: int, stop_ids: Sequence[int]
    ) -> tuple[np.ndarray, list[int]]:
        """The float32 logits of the last prompt token, then argmax decoding up to `max_tokens`
        ids (a stop id ends it and is not included, as prima's `generate` does)."""
        self._llm.reset()
        self._llm.eval(list(prompt_ids))
        logits = np.array(self._llm.scores[len(prompt_ids) - 1], dtype=np.float32)
        greedy: list[int] = []
        nxt = int(np.argmax(logits))
        while len(greedy) < max_tokens and nxt not in stop_ids:
            greedy.append(nxt)
            self._llm.eval([nxt])
            nxt = int(np.argmax(self._llm.scores[self._llm.n_tokens - 1]))
        return logits, greedy

    def close(self) -> None:
        self._llm.close()


def llama_embeddings(path: Path, texts: Sequence[str], pooling: str, n_ctx: int = 512) -> np.ndarray:
    """llama.cpp's unit-length embeddings (n_texts, d_model) of `texts`, pooled `mean` or
    `last` over the final normed hidden states, F32 KV cache, BOS where the vocabulary says."""
    llama_cpp = require_llama_cpp()
    kinds = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
    llm = llama_cpp.Llama(
        model_path=str(path),
        embedding=True,
        pooling_type=kinds[pooling],
        n_ctx=n_ctx,
        n_threads=2,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    try:
        return np.array([llm.embed(t, normalize=True) for t in texts], dtype=np.float32)
    finally:
        llm.close()
