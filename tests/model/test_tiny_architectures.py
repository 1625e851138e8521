"""Every architecture prima claims, end to end with no download: a tiny random-weight F32 model
written by tests/tiny_models.py goes through `load_model`, and its prompt ids, last-token logits
and greedy ids are compared with llama.cpp's for the same file, computed while the test runs
(llama-cpp-python; the test skips without it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.prompt import chat_prompt_ids, prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.model.config import SUPPORTED_ARCHITECTURES
from tests.llama_reference import GGML_TYPE_F16, GGML_TYPE_F32, LlamaF32
from tests.tiny_models import write_tiny_model

# The same F32 weights on both sides, and (unlike the real Gemma 3, see test_windowed_model) random
# weights keep Gemma's fp16 GELU table from amplifying rounding: measured |d| ~1e-5 for all four.
TOLERANCE = 1e-3
# q8 mode keeps K and V in halves and rounds queries and softmax weights to halves before they
# meet them, as llama.cpp's default run does; where a value sits near a rounding boundary the two
# sides' float32 sums (llama.cpp's order differs between its AVX2 and AVX-512 builds) can round
# it apart. Measured on an AVX2-only AMD EPYC: llama q8 |d| 1.14e-3 at logits up to 5.4 (2.1e-4
# of the largest), the other three 0.8-7.6e-4. Allowed: one half-precision step (2^-11) of the
# largest logit.
HALF_STEP = 2.0**-11
PROMPTS = ("The capital of France is", "def add(a, b):\n    return a + b\n\n把大模型装进口袋 12345")
MAX_TOKENS = 8


@pytest.mark.parametrize("mode", ["exact", "q8"])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_tiny_architecture_matches_llama_cpp(tmp_path: Path, arch: str, mode: str) -> None:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, n_layers=3)
    loaded = load_model(path, mode=mode)
    assert loaded.model.config.arch == arch
    tok = loaded.tokenizer
    stops = sorted(tok.stop_ids)
    # q8 mode keeps the KV cache in halves, as llama.cpp does by default; exact mode in float32.
    reference = LlamaF32(path, kv_type=GGML_TYPE_F16 if mode == "q8" else GGML_TYPE_F32)
    try:
        chat = chat_prompt_ids(loaded.gguf.metadata, tok, [{"role": "user", "content": PROMPTS[0]}])
        for text in (*PROMPTS, None):
            ids = chat if text is None else prompt_ids(tok, text)
            if text is not None:
                assert ids == reference.tokenize_prompt(text, add_bos=tok.add_bos_default)
            want_logits, want_greedy = reference.last_logits_and_greedy(ids, MAX_TOKENS, stops)
            result = generate(
                LocalEngine(loaded.model, n_ctx=128),
                ids,
                max_tokens=MAX_TOKENS,
                sampler=SamplerConfig(),
                stop_ids=stops,
            )
            assert result.prompt_logits is not None
            tol = (
                TOLERANCE if mode == "exact" else max(TOLERANCE, HALF_STEP * float(np.abs(want_logits).max()))
            )
            assert np.abs(np.asarray(result.prompt_logits) - want_logits).max() <= tol
            assert result.token_ids == want_greedy
    finally:
        reference.close()
