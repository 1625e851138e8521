"""A model split between a CPU backend and the acl backend (through FakeAcl: not an NPU result),
hidden states passed from one to the other as a ring passes them between nodes, gives the
single-device logits within the acl backend's tolerance and the same greedy tokens. Both
backends run in this process here; tests/cluster/test_ring_npu.py runs the split across
primad processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.backends import get_backend
from prima.backends.base import Backend
from prima.model.files import open_model
from tests.conftest import load_tiny_oracle, tiny_model_path
from tests.tiny_qwen import TINY_TAGS

pytest.importorskip("onnxruntime")

from tests.backends.acl.fake_acl import fake_cann

N_CTX = 64
STEPS = 4


def _greedy(stages: list[tuple[Backend, range]], ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """Prompt logits and STEPS greedy tokens through `stages` (backend, layers) in ring order."""
    head = stages[0][0]
    handles = [(b, b.load_window(layers), b.new_kv(N_CTX, layers)) for b, layers in stages]

    def step(tokens: list[int], start: int) -> np.ndarray:
        h = head.embed(np.array(tokens))
        for backend, window, kv in handles:
            h = backend.run_window(window, h, np.arange(start, start + len(tokens)), kv)
        return head.logits(h[-1:])[0]

    first = logits = step(ids, 0)
    tokens: list[int] = []
    for i in range(STEPS):
        tokens.append(int(np.argmax(logits)))
        logits = step(tokens[-1:], len(ids) + i)
    for backend, window, _ in handles:
        backend.release_window(window)
    return first, tokens


@pytest.mark.parametrize("tag", TINY_TAGS)
def test_cpu_then_npu_equals_one_cpu(tag: str, tmp_path: Path) -> None:
    weights = open_model(tiny_model_path(tag)).weights
    n = weights.config.n_layers
    cpu = get_backend("cpu", weights, threads=1, mode="exact")
    with fake_cann(tmp_path):
        npu = get_backend("acl", weights, threads=1, mode="fp16")
        for prompt in load_tiny_oracle(tag)["prompts"]:
            ids = prompt["prompt_token_ids"]
            want_logits, want_tokens = _greedy([(cpu, range(n))], ids)
            for split in (n // 2,):  # the CPU node holds [0, split), the NPU node the rest
                logits, tokens = _greedy([(cpu, range(split)), (npu, range(split, n))], ids)
                assert np.abs(logits - want_logits).max() <= npu.logit_tolerance
                assert tokens == want_tokens, prompt["name"]
