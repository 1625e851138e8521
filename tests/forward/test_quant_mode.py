"""The default q8 mode (int8 activations) against llama.cpp's logits on the quantized model:
llama.cpp decodes and prefills with int8 activations too, so top-1 must agree and logits stay
close, whether the prompt goes one token per step (the decode kernels) or in one batch (the
int8 GEMM)."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest

from prima.engine.local import LocalEngine
from prima.forward.loader import LoadedModel, load_model
from prima.kernels.matmul import FUSED_MAX_N
from tests.conftest import ORACLE_TAGS, load_oracle


@cache
def _load(tag: str) -> LoadedModel:
    return load_model(tag, mode="q8")


def _prompt_cases() -> list[Any]:
    return [
        pytest.param(tag, p, id=f"{tag}-{p['name']}")
        for tag in ORACLE_TAGS
        for p in load_oracle(tag)["prompts"]
    ]


@pytest.mark.parametrize(("tag", "prompt"), _prompt_cases())
def test_q8_decode_logits_match_llama_cpp_quant(tag: str, prompt: dict[str, Any]) -> None:
    loaded = _load(tag)
    assert loaded.model.backend.mode == "q8"
    model = loaded.model
    n = model.config.n_layers
    cache = model.new_cache(512)
    # One token per step, so every matmul takes the int8 decode path (a batched prefill would
    # not); only the last step needs the (large) output head.
    for pos, t in enumerate(prompt["prompt_token_ids"]):
        h = model.forward_layers(model.embed(np.array([t])), np.array([pos]), 0, n, cache)
    logits = model.output_logits(h[-1:])[0]
    quant = prompt["quant"]["logits"]
    assert int(np.argmax(logits)) == int(np.argmax(quant))
    cosine = float(logits @ quant / (np.linalg.norm(logits) * np.linalg.norm(quant)))
    assert cosine >= 0.998


@pytest.mark.parametrize(("tag", "prompt"), _prompt_cases())
def test_q8_prefill_logits_match_llama_cpp_quant(tag: str, prompt: dict[str, Any]) -> None:
    loaded = _load(tag)
    ids = prompt["prompt_token_ids"]
    assert len(ids) > FUSED_MAX_N  # more rows than the decode kernels take: the int8 GEMM (or BLAS)
    logits = LocalEngine(loaded.model, n_ctx=512).forward(ids)
    quant = prompt["quant"]["logits"]
    assert int(np.argmax(logits)) == int(np.argmax(quant))
    cosine = float(logits @ quant / (np.linalg.norm(logits) * np.linalg.norm(quant)))
    assert cosine >= 0.998
