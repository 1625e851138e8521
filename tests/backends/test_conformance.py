"""Every backend against the Backend protocol's promises (prima.backends.base), on the two tiny
Qwen models with F32 weights and llama.cpp's outputs for them (tests/tiny_qwen.py):

- the prompt's last-token logits are within the backend's `logit_tolerance` of llama.cpp's, and
  decoding on from there gives llama.cpp's greedy tokens;
- layers run in several windows give the bits of one window (if it says so; else logits within
  its tolerance);
- KV state carries across calls: a prompt fed in two calls gives what one call gives;
- a released window loads again and computes the same.

Parametrized over every backend this machine has (CPU exact and q8) and the acl (Ascend NPU)
backend through its labelled test double, FakeAcl (tests/backends/acl/fake_acl.py), which runs
the windows' ONNX graphs with onnxruntime: nothing here is a result from an NPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import pytest

from prima.backends import get_backend
from prima.backends.base import Backend
from prima.model.files import open_model
from tests.conftest import load_tiny_oracle, tiny_model_path
from tests.tiny_qwen import TINY_TAGS

BACKENDS: list[tuple[str, str]] = [("cpu", "exact"), ("cpu", "q8"), ("acl", "fp16")]
N_CTX = 128


def _test_double(name: str, tmp: pytest.TempPathFactory) -> AbstractContextManager[object]:
    """What a backend without its hardware runs on here: acl on FakeAcl and a stand-in ATC."""
    if name != "acl":
        return nullcontext()
    pytest.importorskip("onnxruntime")
    from tests.backends.acl.fake_acl import fake_cann

    return fake_cann(tmp.mktemp("cann"))


@pytest.fixture(
    scope="module", params=[(b, m, t) for b, m in BACKENDS for t in TINY_TAGS], ids=lambda p: "-".join(p)
)
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Backend, list[dict[str, Any]]]]:
    name, mode, tag = request.param
    weights = open_model(tiny_model_path(tag)).weights
    with _test_double(name, tmp_path_factory):
        yield get_backend(name, weights, threads=2, mode=mode), load_tiny_oracle(tag)["prompts"]


def _all_layers(backend: Backend) -> range:
    return range(backend.config.n_layers)


def _prefill(backend: Backend, ids: list[int], cuts: list[int], windows: list[range]) -> np.ndarray:
    """Last-token logits of `ids`, fed in pieces ending at `cuts`, through `windows` in turn."""
    handles = [backend.load_window(w) for w in windows]
    kv = backend.new_kv(N_CTX, _all_layers(backend))
    start = 0
    h_last = None
    for end in [*cuts, len(ids)]:
        h = backend.embed(np.array(ids[start:end]))
        positions = np.arange(start, end)
        for handle in handles:
            h = backend.run_window(handle, h, positions, kv)
        h_last = h[-1:]
        start = end
    for handle in handles:
        backend.release_window(handle)
    assert h_last is not None
    return backend.logits(h_last)[0]


def _oracle_logits(prompt: dict[str, Any], backend: Backend) -> np.ndarray:
    """llama.cpp's logits from its run with the KV cache the backend keeps: the CPU's halves
    (q8 mode) are llama.cpp's default (`quant`, same F32 weights), otherwise the `f32` run."""
    halves = backend.name == "cpu" and np.dtype(getattr(backend, "kv_dtype", np.float32)) == np.float16
    return prompt["quant" if halves else "f32"]["logits"]


def test_logits_and_greedy_tokens_match_llama_cpp(case: tuple[Backend, list[dict[str, Any]]]) -> None:
    backend, prompts = case
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        want = prompt["f32"]["greedy_token_ids"]
        window = backend.load_window(_all_layers(backend))
        kv = backend.new_kv(N_CTX, window.layers)
        h = backend.run_window(window, backend.embed(np.array(ids)), np.arange(len(ids)), kv)
        logits = backend.logits(h[-1:])[0]
        err = float(np.abs(logits - _oracle_logits(prompt, backend)).max())
        assert err <= backend.logit_tolerance, f"{prompt['name']}: {err} > {backend.logit_tolerance}"
        want_logits = _oracle_logits(prompt, backend)
        cos = float(logits @ want_logits / np.linalg.norm(logits) / np.linalg.norm(want_logits))
        assert cos >= 0.999, f"{prompt['name']}: cosine {cos}"
        got = []
        for pos in range(len(ids), len(ids) + len(want)):
            token = int(np.argmax(logits))
            got.append(token)
            h = backend.run_window(window, backend.embed(np.array([token])), np.array([pos]), kv)
            logits = backend.logits(h)[0]
        assert got == want, prompt["name"]
        backend.release_window(window)


def test_windows_give_what_one_window_gives(case: tuple[Backend, list[dict[str, Any]]]) -> None:
    """The same bits where the backend promises them (`windows_bit_identical`), else logits
    within its `logit_tolerance` of one window's."""
    backend, prompts = case
    n = backend.config.n_layers
    ids = prompts[0]["prompt_token_ids"]
    whole = _prefill(backend, ids, [], [range(n)])
    for windows in ([range(0, 1), range(1, n)], [range(i, i + 1) for i in range(n)]):
        split = _prefill(backend, ids, [], windows)
        if backend.windows_bit_identical:
            np.testing.assert_array_equal(split, whole)
        else:
            assert np.abs(split - whole).max() <= backend.logit_tolerance


def test_kv_state_carries_across_calls(case: tuple[Backend, list[dict[str, Any]]]) -> None:
    backend, prompts = case
    n = backend.config.n_layers
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        for cuts in ([len(ids) // 2], [1, 2, 3]):
            logits = _prefill(backend, ids, cuts, [range(n)])
            assert np.abs(logits - _oracle_logits(prompt, backend)).max() <= backend.logit_tolerance


def test_a_released_window_loads_again(case: tuple[Backend, list[dict[str, Any]]]) -> None:
    backend, prompts = case
    ids = prompts[0]["prompt_token_ids"]
    first = _prefill(backend, ids, [], [_all_layers(backend)])  # loads and releases
    np.testing.assert_array_equal(_prefill(backend, ids, [], [_all_layers(backend)]), first)


def test_kv_state_reports_its_size_and_truncates(case: tuple[Backend, list[dict[str, Any]]]) -> None:
    backend, prompts = case
    cfg = backend.config
    kv = backend.new_kv(N_CTX, range(2))
    assert (
        kv.n_bytes >= 2 * 2 * N_CTX * cfg.n_kv_heads * cfg.head_dim * 2
    )  # k and v, two layers, halves or more
    window = backend.load_window(range(2))
    ids = prompts[0]["prompt_token_ids"][:4]
    h0 = backend.run_window(window, backend.embed(np.array(ids)), np.arange(4), kv)
    kv.truncate(2)  # replay from position 2: the same tokens give the same states
    h1 = backend.run_window(window, backend.embed(np.array(ids[2:])), np.arange(2, 4), kv)
    np.testing.assert_allclose(h1, h0[2:], rtol=0, atol=1e-5)
