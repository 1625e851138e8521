"""The one-call decode block against the step-by-step path it replaces: same kernels in the same
order, so the same bits, on both test models, in both modes, for 1 to 4 tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from numba import njit

from prima.forward.loader import LoadedModel, load_model
from prima.kernels import decode_layer as dl
from prima.kernels import lanes, ops_compiled
from prima.kernels import matmul as mm
from prima.kernels import ops_reference as ops
from prima.kernels.quants import F16_TABLE
from tests.tiny_models import write_tiny_model

from .weights import random_qtensor

Q = GGMLQuantizationType


@cache
def _load(path: Path, mode: str) -> LoadedModel:
    return load_model(path, threads=2, mode=mode)


@contextmanager
def _blocks(loaded: LoadedModel, fused: bool) -> Iterator[None]:
    """Blocks run as one call (fused) or step by step (the backend takes no token count fused)."""
    backend = loaded.model.backend
    saved = backend.fused_max_tokens
    backend.fused_max_tokens = saved if fused else 0
    try:
        yield
    finally:
        backend.fused_max_tokens = saved


def _decode(loaded: LoadedModel, fused: bool, ids: list[int], n_step: int) -> list[np.ndarray]:
    """Hidden states after every layer-stack pass: a 6-token prompt in steps of n_step tokens."""
    model = loaded.model
    with _blocks(loaded, fused):
        cache_ = model.new_cache(32)
        out = []
        for s in range(0, len(ids), n_step):
            chunk = np.array(ids[s : s + n_step])
            h = model.embed(chunk)
            out.append(
                model.forward_layers(h, np.arange(s, s + chunk.size), 0, model.config.n_layers, cache_)
            )
        return out


@pytest.mark.parametrize("mode", ["q8", "exact"])
@pytest.mark.parametrize("n_step", [1, 3])
@pytest.mark.parametrize("model_name", ["smollm2_path", "gemma3_path"])
def test_fused_block_equals_step_by_step(
    model_name: str, n_step: int, mode: str, request: pytest.FixtureRequest
) -> None:
    loaded = _load(request.getfixturevalue(model_name), mode)
    model = loaded.model
    window = model.backend.load_window(range(model.config.n_layers))
    assert all(block is not None for block in window.fused)
    ids = [int(t) for t in loaded.tokenizer.encode("The quick brown fox")][:6]
    fused = _decode(loaded, True, ids, n_step)
    steps = _decode(loaded, False, ids, n_step)
    for a, b in zip(fused, steps, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_fused_block_of_float_weights_equals_step_by_step(
    qtype: GGMLQuantizationType, tmp_path: Path
) -> None:
    """Float weights decode in one call too (their rows read as stored by the row-group
    kernels), with the bits of the step-by-step path, 1 and 3 tokens a step."""
    path = write_tiny_model(tmp_path / f"{qtype.name}.gguf", qtype=qtype, n_layers=3)
    loaded = load_model(path, threads=2, mode="q8")
    model = loaded.model
    window = model.backend.load_window(range(model.config.n_layers))
    assert all(block is not None for block in window.fused)
    ids = [5, 9, 2, 14, 7, 30]
    for n_step in (1, 3):
        fused = _decode(loaded, True, ids, n_step)
        steps = _decode(loaded, False, ids, n_step)
        for a, b in zip(fused, steps, strict=True):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@njit(cache=True)
def _half_bits_all(values: np.ndarray, out: np.ndarray) -> None:
    for i in range(values.shape[0]):
        out[i] = lanes.half_bits(values[i])


def _f16_bits_all(values: np.ndarray, out: np.ndarray) -> None:
    out[:] = [lanes.f16_bits(v) for v in values]


@pytest.mark.parametrize("convert", [_f16_bits_all, _half_bits_all], ids=["arithmetic", "instruction"])
def test_f16_bits_rounds_as_numpy(convert: Callable[[np.ndarray, np.ndarray], None]) -> None:
    """Every half's own value, every midpoint between neighbouring halves (ties go to even),
    values just beside them, overflow, NaN, and random floats of every magnitude: by bit
    arithmetic (lanes.f16_bits) and by the CPU's instruction where it has one (half_bits)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float32)
    ordered = np.unique(finite)
    mids = ((ordered[:-1].astype(np.float64) + ordered[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            finite,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
            np.array([65504, 65519.99, 65520, 1e6, np.inf, -np.inf, 0.0, -0.0, 1e-8, 6e-8], np.float32),
            (rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 6, 20000)).astype(np.float32),
        ]
    )
    got = np.empty(values.shape, dtype=np.uint16)
    convert(values, got)
    with np.errstate(over="ignore"):  # the overflow to infinity is part of what is checked
        expected = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, expected)
    nan = np.empty(1, dtype=np.uint16)
    convert(np.array([np.nan], dtype=np.float32), nan)
    assert np.isnan(nan.view(np.float16)[0])


def test_gelu_mul_matches_the_table_gelu() -> None:
    rng = np.random.default_rng(1)
    gate_up = (rng.standard_normal((2, 64)) * 6).astype(np.float32)
    gate_up[0, :4] = [-10.0, 10.0, -30.0, 30.0]
    expected = ops.gelu(gate_up[:, :32]) * gate_up[:, 32:]
    np.testing.assert_array_equal(ops_compiled.gelu_mul(gate_up, 32, ops.gelu_fp16_table()), expected)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize(
    "formats",
    [
        (Q.Q5_0, Q.Q5_0, Q.Q5_0),
        (Q.Q5_0, Q.Q5_0, Q.Q8_0),
        (Q.Q4_K, Q.Q6_K, Q.Q6_K),
        (Q.Q4_1, Q.Q8_0, Q.Q6_K),
        (Q.F16, Q.F16, Q.F16),
        (Q.BF16, Q.F16, Q.F32),
        (Q.F32, Q.F32, Q.Q8_0),
    ],
    ids=lambda f: "-".join(q.name for q in f),
)
def test_projections_of_mixed_formats_are_grouped_as_matmul_many(
    formats: tuple[GGMLQuantizationType, ...], int8: bool
) -> None:
    """q/k/v (or gate/up) whose formats differ run as one launch per run of equal formats; the
    result is the concatenation of matmul_many's, whatever the grouping."""
    ws = [
        random_qtensor(q, rows, 256, seed=i)
        for i, (q, rows) in enumerate(zip(formats, (64, 32, 32), strict=True))
    ]
    x = np.random.default_rng(2).standard_normal((2, 256)).astype(np.float32)
    raws = [w.raw.view() for w in ws]
    for r in raws:
        r.flags.writeable = False
    got = dl._project3(*(int(q) for q in formats), *raws, x, int8, F16_TABLE)
    expected = np.concatenate([mm.matmul(w, x, int8) for w in ws], axis=1)
    np.testing.assert_array_equal(got, expected)


def test_fused_block_with_a_long_context_uses_parallel_attention_and_agrees(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past attention_compiled.attention_parallel_min keys the block's attention runs in parallel; still
    the step-by-step path's bits."""
    from prima.kernels import attention_compiled

    loaded = _load(smollm2_path, "q8")
    model = loaded.model
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # spinning workers: the lower threshold
    n_prompt = attention_compiled.ATTENTION_PARALLEL_MIN_SPINNING + 8
    ids = np.arange(100, 100 + n_prompt + 2)
    results = []
    n = model.config.n_layers
    for fused in (True, False):
        with _blocks(loaded, fused):
            cache_ = model.new_cache(n_prompt + 4)
            model.forward_layers(model.embed(ids[:n_prompt]), np.arange(n_prompt), 0, n, cache_)
            results.append(
                [
                    model.forward_layers(model.embed(ids[p : p + 1]), np.array([p]), 0, n, cache_)
                    for p in (n_prompt, n_prompt + 1)
                ]
            )
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)
