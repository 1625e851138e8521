"""The default q8 mode (int8 decode activations) against llama.cpp's logits on the quantized
model: llama.cpp decodes with int8 activations too, so top-1 must agree and logits stay close."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest

from prima.forward.loader import LoadedModel, load_model
from tests.conftest import ORACLE_DIR, ORACLE_TAGS, load_oracle


@cache
def _load(tag: str) -> LoadedModel:
    return load_model(tag, mode="q8")


def _prompt_cases() -> list[Any]:
    if not ORACLE_DIR.is_dir():
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="no oracle"))]
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
    quant = np.load(ORACLE_DIR / prompt["quant"]["logits_file"])
    assert int(np.argmax(logits)) == int(np.argmax(quant))
    cosine = float(logits @ quant / (np.linalg.norm(logits) * np.linalg.norm(quant)))
    assert cosine >= 0.998
