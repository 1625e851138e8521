"""llama.cpp itself (through llama-cpp-python) as a reference computed while the tests run.

The shared oracle holds llama.cpp's outputs for fixed strings and prompts; these helpers produce
the same kind of reference for strings, prompts and files the oracle does not have (held-out
cases, other `tokenizer.ggml.pre` values, tiny models written by tests). Tests that use them skip
with the reason when llama-cpp-python is not installed (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

GGML_TYPE_F32 = 0  # ggml_type: an F32 KV cache, as the oracle's `f32` runs use


def require_llama_cpp() -> ModuleType:
    """The llama_cpp module, or skip the calling test with the reason."""
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed; it computes the reference for this test"
    )


def copy_metadata(
    src: Path, dst: Path, overrides: dict[str, Any] | None = None, drop: Sequence[str] = ()
) -> Path:
    """A tensor-less GGUF with `src`'s metadata, some keys replaced (`overrides`, string values)
    or removed (`drop`): enough for llama.cpp to load the vocabulary (`vocab_only`)."""
    overrides = overrides or {}
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in overrides:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), kind)
    for key, value in overrides.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_tokenize(path: Path, texts: Sequence[str]) -> list[list[int]]:
    """llama.cpp's ids for each text: no BOS, special tokens not parsed (as the oracle's `tokenize`)."""
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts]
    finally:
        llm.close()


class LlamaF32:
    """A model in llama.cpp with the oracle's `f32` settings: F32 KV cache, no flash attention."""

    def __init__(self, path: Path, n_ctx: int = 512) -> None:
        llama_cpp = require_llama_cpp()
        self._llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=2,
            logits_all=True,
            type_k=GGML_TYPE_F32,
            type_v=GGML_TYPE_F32,
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
