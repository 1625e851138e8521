"""A generation resumed from its prompt plus the tokens already sampled (what a failover sends
the new ring) continues exactly as the unbroken run, also with a seeded sampler."""

from __future__ import annotations

import numpy as np

from prima.engine.generate import GenerateRequest, GenerationDone, sample_tokens
from prima.engine.sampling import SamplerConfig

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
