"""Sampling filters on hand-made logit vectors."""

from __future__ import annotations

import numpy as np
import pytest

from prima.engine.sampling import Sampler, SamplerConfig, apply_repeat_penalty
from prima.errors import InputError


def test_greedy_takes_argmax() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplerConfig()).sample(logits) == 1


def test_seed_reproduces_and_top_k_limits_choices() -> None:
    logits = np.linspace(0, 1, 50).astype(np.float32)
    cfg = SamplerConfig(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=7)
    a = [Sampler(cfg).sample(logits) for _ in range(3)]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    seq1 = [s1.sample(logits) for _ in range(40)]
    seq2 = [s2.sample(logits) for _ in range(40)]
    assert seq1 == seq2
    assert set(seq1) <= {47, 48, 49}
    assert len(set(seq1)) > 1
    assert a[0] == a[1] == a[2]


def test_top_p_and_min_p_cut_the_tail() -> None:
    logits = np.array([10.0, 9.0, 0.0, -5.0], dtype=np.float32)
    only_top = SamplerConfig(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=1)
    assert {Sampler(only_top).sample(logits) for _ in range(20)} == {0}
    s = Sampler(SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=1))
    assert {s.sample(logits) for _ in range(200)} <= {0, 1}


def test_repeat_penalty_lowers_seen_tokens() -> None:
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repeat_penalty(logits, [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert Sampler(SamplerConfig(repeat_penalty=4.0)).sample(logits, history=[0]) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"min_p": 1.0},
        {"top_k": -2},
        {"repeat_penalty": 0.0},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"min_p": float("nan")},
        {"repeat_penalty": float("nan")},
        {"repeat_penalty": float("inf")},
    ],
)
def test_bad_sampler_settings_are_rejected_naming_the_setting(kwargs: dict[str, float]) -> None:
    (name,) = kwargs
    with pytest.raises(InputError, match=name.replace("_", "[- ]")):
        SamplerConfig(**kwargs)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-30])
def test_a_vanishing_temperature_samples_the_best_token(temperature: float) -> None:
    """However small a positive temperature, the draw is the top token, never NaN probabilities
    (5e-324 is 0 in float32: dividing by it once gave "Probabilities contain NaN")."""
    logits = np.array([0.5, 3.0, -2.0, 2.999], dtype=np.float32)
    sampler = Sampler(SamplerConfig(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert [sampler.sample(logits) for _ in range(5)] == [1] * 5


@pytest.mark.parametrize(
    ("penalty", "logits", "expected"),
    [
        (1e-310, [0.5, 3.0, -2.0], 0),  # seen 0.5 / 1e-310 overflows float32: the top token
        (1e308, [-0.5, -3.0, -2.0], 0),  # every token seen: -0.5 * 1e308 stays the least negative
    ],
)
def test_an_extreme_repeat_penalty_never_makes_probabilities_nan(
    penalty: float, logits: list[float], expected: int
) -> None:
    """A repeat penalty whose division or product overflows float32 once gave infinite logits,
    then NaN probabilities ("Probabilities contain NaN", UNKNOWN on the daemon): found by the
    member fuzz (tests/net/member_fuzz.py)."""
    history = [0] if penalty < 1 else [0, 1, 2]
    config = SamplerConfig(temperature=0.5, repeat_penalty=penalty, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    out = apply_repeat_penalty(np.array(logits, dtype=np.float32), history, penalty)
    assert np.isfinite(out).all()
    assert Sampler(config).sample(np.array(logits, dtype=np.float32), history) == expected


def test_sampler_resumed_at_step_n_draws_what_the_unbroken_run_draws() -> None:
    """A generation resumed after a failover starts its sampler at the tokens already sampled."""
    logits = np.linspace(0, 1, 50).astype(np.float32)
    cfg = SamplerConfig(temperature=5.0, top_k=10, top_p=1.0, min_p=0.0, seed=11)
    whole = Sampler(cfg)
    unbroken = [whole.sample(logits) for _ in range(30)]
    resumed = Sampler(cfg, step=17)
    assert [resumed.sample(logits) for _ in range(13)] == unbroken[17:]
    assert len(set(unbroken)) > 1


def test_sampler_step_must_not_be_negative() -> None:
    with pytest.raises(InputError, match="step"):
        Sampler(SamplerConfig(), step=-1)
