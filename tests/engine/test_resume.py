"""A generation resumed from its prompt plus the tokens already sampled (what a failover sends
the new ring) continues exactly as the unbroken run, also with a seeded sampler: the tokens
sampled before are fed as decoding fed them, so the rebuilt KV cache has the unbroken run's bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.engine.generate import GenerateRequest, GenerationDone, prefill, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from tests.tiny_models import write_tiny_model

VOCAB = 40


class _HistoryEngine:
    """Logits that depend on every token fed so far, so a wrong cache shows in the output."""

    n_ctx = 256

    def __init__(self) -> None:
        self.fed: list[int] = []

    def reset(self) -> None:
        self.fed = []

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        self.fed += [int(t) for t in token_ids]
        rng = np.random.default_rng(sum((i + 1) * t for i, t in enumerate(self.fed)))
        return rng.standard_normal(VOCAB).astype(np.float32)


def _tokens(request: GenerateRequest) -> list[int]:
    return [e for e in sample_tokens(_HistoryEngine(), request) if not isinstance(e, GenerationDone)]


def test_resumed_generation_equals_the_unbroken_one() -> None:
    prompt = (3, 1, 4, 1, 5)
    for sampler in (SamplerConfig(), SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=9)):
        whole = _tokens(GenerateRequest(prompt, 24, sampler))
        assert len(whole) == 24
        for cut in (1, 10, 23):
            resumed = GenerateRequest(prompt + tuple(whole[:cut]), 24 - cut, sampler, first_step=cut)
            assert whole[:cut] + _tokens(resumed) == whole, (sampler, cut)


class _SplitEngine(_HistoryEngine):
    """Records how each call fed the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        self.calls.append(("forward", [int(t) for t in token_ids]))
        return super().forward(token_ids)


class _ReplayEngine(_SplitEngine):
    def forward_decoded(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        self.calls.append(("decoded", [int(t) for t in token_ids]))
        return _HistoryEngine.forward(self, token_ids)


def test_a_resumed_prompt_feeds_its_sampled_tokens_as_decoding_did() -> None:
    replaying = _ReplayEngine()
    prefill(replaying, [3, 1, 4, 1, 5, 9, 2], decoded=3)
    assert replaying.calls == [("forward", [3, 1, 4, 1]), ("decoded", [5, 9, 2])]
    # An engine without forward_decoded gets them one at a time, as decoding fed them.
    plain = _SplitEngine()
    prefill(plain, [3, 1, 4, 1, 5, 9, 2], decoded=3)
    assert plain.calls == [("forward", [3, 1, 4, 1]), ("forward", [5]), ("forward", [9]), ("forward", [2])]
    # A fresh prompt, and at least its first token, is prefilled as one.
    for decoded, first in ((0, 7), (7, 1), (9, 1)):
        engine = _ReplayEngine()
        prefill(engine, [3, 1, 4, 1, 5, 9, 2], decoded=decoded)
        assert engine.calls[0] == ("forward", [3, 1, 4, 1, 5, 9, 2][:first])


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model in Q4_1: its prefill takes the int8 GEMM (q8) or dequantized tiles
    and BLAS (exact), decode the fused per-row kernels."""
    path = tmp_path_factory.mktemp("replay") / "tiny-q4_1.gguf"
    return write_tiny_model(path, n_layers=3, d_model=128, ffn=256, qtype=GGMLQuantizationType.Q4_1)


@pytest.mark.parametrize("mode", ["q8", "exact"])
def test_a_replayed_cache_has_the_bits_decoding_gave_it(tiny_q4_1: Path, mode: str) -> None:
    """The KV cache rebuilt from the prompt and the tokens decoded so far (what a failover's new
    ring computes) and every logit after it equal the unbroken run's, bit for bit. The prompt
    and the replayed tokens are long enough for batched prefill, whose arithmetic differs from
    decode's (in q8 mode by ~0.04 in this model's logits)."""
    model = load_model(tiny_q4_1, mode=mode).model
    assert model.backend.batch_identical_tokens > 1  # the replay runs batches, not single tokens
    prompt = [5, 17, 60, 33, 2, 99, 120, 7, 41, 8, 77]
    unbroken = LocalEngine(model, n_ctx=64)
    logits = [unbroken.forward(prompt)]
    decoded: list[int] = []
    for _ in range(9):
        decoded.append(int(np.argmax(logits[-1])))
        logits.append(unbroken.forward(decoded[-1:]))
    replayed = LocalEngine(model, n_ctx=64)
    assert np.array_equal(prefill(replayed, prompt + decoded, len(decoded)), logits[-1])
    n = len(prompt) + len(decoded)
    for layer in range(model.config.n_layers):
        assert np.array_equal(replayed.cache.k[layer][:n], unbroken.cache.k[layer][:n]), layer
        assert np.array_equal(replayed.cache.v[layer][:n], unbroken.cache.v[layer][:n]), layer
    for token in (3, 90, 14):
        assert np.array_equal(replayed.forward([token]), unbroken.forward([token]))


def test_a_resumed_generation_on_a_quantized_model_equals_the_unbroken_one(tiny_q4_1: Path) -> None:
    """sample_tokens on a real engine, q8, greedy and seeded: the resumed run's tokens go on as
    the unbroken run's."""
    model = load_model(tiny_q4_1).model
    prompt = (5, 17, 60, 33, 2, 99, 120, 7, 41, 8, 77)

    def tokens(request: GenerateRequest) -> list[int]:
        engine = LocalEngine(model, n_ctx=64)
        return [e for e in sample_tokens(engine, request) if not isinstance(e, GenerationDone)]

    seeded = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    for sampler in (SamplerConfig(), seeded):
        whole = tokens(GenerateRequest(prompt, 24, sampler))
        for cut in (6, 13):
            resumed = GenerateRequest(prompt + tuple(whole[:cut]), 24 - cut, sampler, first_step=cut)
            assert whole[:cut] + tokens(resumed) == whole, (sampler, cut)
