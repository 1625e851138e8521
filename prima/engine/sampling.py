"""Token sampling: greedy, temperature, top-k, top-p, min-p and a repetition penalty.

Pure numpy over one logit vector. Each draw's randomness is derived from (seed, step), so a seed
reproduces a run exactly and a generation resumed at step n (after a failover re-planned the ring)
draws what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prima.errors import InputError


@dataclass(frozen=True)
class SamplerConfig:
    """temperature 0 means greedy (argmax); the filters apply in llama.cpp's order:
    repetition penalty, top-k, top-p, min-p, then temperature."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        labels = {
            "temperature": "temperature",
            "top_p": "top-p",
            "min_p": "min-p",
            "repeat_penalty": "repeat penalty",
        }
        for name, label in labels.items():
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{label} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise InputError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise InputError(f"repeat penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Samples token after token; `step` counts the draws of this generation so far (a resumed
    generation starts at the number of tokens already sampled)."""

    def __init__(self, config: SamplerConfig, step: int = 0) -> None:
        if step < 0:
            raise InputError(f"the sampler's first step must be >= 0, got {step}")
        self.config = config
        self.step = step
        # Unseeded runs draw their entropy once, so their steps still differ from each other.
        self._entropy = np.random.SeedSequence(config.seed).entropy

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        cfg = self.config
        step, self.step = self.step, self.step + 1
        logits = np.asarray(logits, dtype=np.float32)
        if cfg.repeat_penalty != 1.0 and history:
            logits = apply_repeat_penalty(logits, history[-cfg.repeat_last_n :], cfg.repeat_penalty)
        if cfg.greedy:
            return int(np.argmax(logits))
        ids = np.argsort(-logits, kind="stable")
        if cfg.top_k:
            ids = ids[: cfg.top_k]
        probs = _softmax(logits[ids])
        if cfg.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), cfg.top_p) + 1)
            ids, probs = ids[:keep], probs[:keep]
        if cfg.min_p > 0.0:
            mask = probs >= cfg.min_p * probs[0]
            ids = ids[mask]
        # Shifted so the best logit is 0 before dividing: however small the temperature (5e-324
        # is a float), the others go to -inf or stay finite, never inf - inf.
        kept = logits[ids].astype(np.float64)
        with np.errstate(over="ignore"):  # an overflow is -inf: that token's probability is 0
            probs = _softmax((kept - kept.max()) / cfg.temperature)
        # A generator per (seed, step): draw n needs no replay of draws 0..n-1.
        rng = np.random.default_rng(np.random.SeedSequence([self._entropy, step]))
        return int(rng.choice(ids, p=probs))


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """Make recently seen tokens less likely (divide positive logits, multiply negative ones).
    Kept finite: a penalty of 1e-310 or 1e308 overflows float32, and infinite logits would make
    the probabilities NaN; the largest float32 keeps such a token first (or last)."""
    out = logits.copy()
    seen = np.unique(np.asarray(recent, dtype=np.int64))
    vals = out[seen]
    # In float32, as llama.cpp; an overflow (or a penalty that is 0 or inf in float32) is clipped.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        penalized = np.where(vals > 0, vals / penalty, vals * penalty)
    big = np.finfo(np.float32).max
    out[seen] = np.clip(penalized, -big, big)
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()
