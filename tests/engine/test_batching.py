"""Continuous batching on this device: decode steps of several sessions in one pass give each
session exactly the logits it gets alone, and concurrent greedy generations through a batching
pool equal the same requests run one at a time. Real model (SmolLM2), real threads."""

from __future__ import annotations

import copy
import threading
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from prima.engine.batching import DecodeBatcher
from prima.engine.generate import GenerateRequest, GenerationDone, LocalGenerator, TokenEvent
from prima.engine.local import LocalEngine, local_generator
from prima.engine.prompt import prompt_ids
from prima.engine.turns import TurnTaking
from prima.forward.loader import LoadedModel, load_model

N_CTX = 128
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def add(a, b):",
    "Water boils at",
    "Hi",
    "1, 2, 3,",
]
MAX_TOKENS = 8
WAIT_S = 120.0  # a bound for a loaded machine, not an expectation


@cache
def _smollm2(path: Path) -> LoadedModel:
    return load_model(path)


def _prefilled(loaded: LoadedModel) -> list[tuple[LocalEngine, int]]:
    """An engine per prompt with the prompt run, and its greedy next token."""
    out = []
    for text in PROMPTS:
        engine = LocalEngine(loaded.model, N_CTX)
        logits = engine.forward(prompt_ids(loaded.tokenizer, text))
        out.append((engine, int(np.argmax(logits))))
    return out


def test_a_batched_decode_step_gives_each_session_its_own_bits(smollm2_path: Path) -> None:
    loaded = _smollm2(smollm2_path)
    sessions = _prefilled(loaded)
    alone = []
    for engine, token in sessions:
        twin = LocalEngine(loaded.model, N_CTX)
        twin.cache = copy.deepcopy(engine.cache)
        twin.count_written(np.array(engine.held_tokens))
        alone.append(twin.forward([token]))

    turns = TurnTaking()
    batcher = DecodeBatcher(turns)
    got: dict[int, np.ndarray] = {}
    with turns.turn():  # hold the model while every step queues up behind this turn
        threads = [
            threading.Thread(target=lambda i=i, e=e, t=t: got.__setitem__(i, batcher.step(e, t)))
            for i, (e, t) in enumerate(sessions)
        ]
        for th in threads:
            th.start()
        deadline = time.monotonic() + WAIT_S
        while len(batcher._pending) < len(sessions) and time.monotonic() < deadline:
            time.sleep(0.01)
    for th in threads:
        th.join(WAIT_S)
    # Passes of at most 4 (the CPU's fused per-row kernels): 6 steps in two passes.
    assert loaded.model.decode_batch_rows == 4
    assert batcher.batch_sizes == [4, 2]
    for i, (engine, _) in enumerate(sessions):
        assert got[i].tobytes() == alone[i].tobytes()
        assert engine.n_past == sessions[i][0].n_past


def _tokens(events: list[TokenEvent]) -> list[int]:
    assert isinstance(events[-1], GenerationDone)
    return [int(e) for e in events if not isinstance(e, GenerationDone)]


@pytest.mark.slow
def test_concurrent_generations_equal_each_run_alone(smollm2_path: Path) -> None:
    loaded = _smollm2(smollm2_path)
    requests = [
        GenerateRequest(tuple(prompt_ids(loaded.tokenizer, p)), MAX_TOKENS, n_ctx=N_CTX) for p in PROMPTS
    ]
    single = LocalGenerator(LocalEngine(loaded.model, N_CTX))
    want = [_tokens(list(single.generate(r))) for r in requests]

    pool = local_generator(loaded, N_CTX, parallel=len(PROMPTS))  # more than one pass holds
    assert pool.batcher is not None
    got: dict[int, list[TokenEvent]] = {}
    threads = [
        threading.Thread(target=lambda i=i, r=r: got.__setitem__(i, list(pool.generate(r))))
        for i, r in enumerate(requests)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S)
    assert [_tokens(got[i]) for i in range(len(requests))] == want
    # Every one-token pass ran in some batch: one after each token but the budget's last, and
    # a prompt of one token ("Hi").
    steps = sum(len(w) if len(w) < MAX_TOKENS else MAX_TOKENS - 1 for w in want)
    one_token_prompts = sum(len(r.prompt_ids) == 1 for r in requests)
    assert one_token_prompts == 1
    assert sum(pool.batcher.batch_sizes) == steps + one_token_prompts
    assert max(pool.batcher.batch_sizes) <= loaded.model.decode_batch_rows


def test_a_pool_of_one_does_not_batch(smollm2_path: Path) -> None:
    assert local_generator(_smollm2(smollm2_path), N_CTX, parallel=1).batcher is None
