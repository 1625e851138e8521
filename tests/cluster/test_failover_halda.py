"""Gemma on a ring of four daemons planned by Halda, each --mem-budget holding 7 of its 18 layers
(with an 8192-token KV cache planned for, no disk streams enough to add more, so three nodes are
needed). One ring carries the whole story: a seeded, sampled generation that also asks for the
prompt's logits loses a follower mid-generation, Halda re-plans over the nodes left, and the
tokens equal the unbroken seeded run while the logits match llama.cpp; then the head dies with
only two nodes left, which cannot hold the model: a clear error, and no survivor keeps a session;
then the killed follower comes back at another address, advertised over mDNS (127.0.0.1 only),
and the next generation's re-plan finds it and uses it."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.coordinator.failover import FailoverRing, RingSpec, advertised
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.planner import HaldaOptions
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, GenerationDone, generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.errors import NodeError
from prima.forward.loader import load_model
from prima.model.gguf_file import GGUFFile
from prima.net.client import NodeClient
from prima.net.discovery import AdvertWatch
from prima.scheduler.profile_schema import ModelProfile

from .conftest import N_CTX, UBATCH, start_ring

pytestmark = pytest.mark.slow

BUDGET = "28M"  # 7 layers of 3.8 MiB each
PLANNED_CTX = 8192  # KV cache Halda plans for: 16 MiB per layer leaves no room to stream more
MAX_TOKENS = 64
SEEDED = SamplerConfig(temperature=0.8, seed=11)
F32_TOLERANCE = 2e-2  # tests/forward/test_windowed_model.py's bound for Gemma's float32 logits
CONNECT_TIMEOUT_S = 60.0
ADVERT_WAIT_S = 20.0  # each daemon measures its profile once, on busy cores


def _request(prompt: list[int], max_tokens: int, *, logits: bool = False) -> GenerateRequest:
    return GenerateRequest(
        tuple(prompt), max_tokens, SEEDED, n_ctx=N_CTX, ubatch=UBATCH, want_prompt_logits=logits
    )


def _unbroken(model_path: Path, prompt: list[int]) -> list[int]:
    """The seeded run on one device, the run every ring must reproduce."""
    loaded = load_model(model_path, mode="exact")
    engine = LocalEngine(loaded.model, n_ctx=N_CTX, ubatch=UBATCH)
    return generate(engine, prompt, max_tokens=MAX_TOKENS, sampler=SEEDED).token_ids


def _sessions(address: str) -> int:
    client = NodeClient(address)
    try:
        return client.info(timeout_s=10).sessions
    finally:
        client.close()


def _run(
    ring: FailoverRing, request: GenerateRequest, local: LocalRing, victim: int, at: int
) -> list[object]:
    """Every event of `request`, killing daemon `victim` once event `at` has arrived."""
    events: list[object] = []
    for i, event in enumerate(ring.generate(request)):
        events.append(event)
        if i == at:
            local.kill(victim)
    return events


def _wait_until_advertised(watch: AdvertWatch, address: str) -> None:
    """Readiness: the daemon's mDNS announcement has reached `watch` (bounded)."""
    deadline = time.monotonic() + ADVERT_WAIT_S
    while address not in {a.address for a in watch.adverts()}:
        assert time.monotonic() < deadline, f"{address} was not advertised within {ADVERT_WAIT_S:g} s"
        time.sleep(0.1)


@pytest.fixture
def four_nodes(mdns_env: None, gemma3_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(4, gemma3_path, ring_logs / "gemma-halda", mem_budgets=[BUDGET] * 4)


def test_gemma_halda_ring_of_four_recovers_then_fails_clearly_then_rejoins(
    four_nodes: LocalRing,
    gemma3_path: Path,
    ring_logs: Path,
    oracle: Callable[[str], dict[str, Any]],
) -> None:
    case = next(p for p in oracle("gemma3-270m")["prompts"] if p["name"] == "capital")
    prompt = case["prompt_token_ids"]
    want_logits = case["f32"]["logits"]
    expected = _unbroken(gemma3_path, prompt)
    local = four_nodes
    index = {n.node_id: i for i, n in enumerate(local.nodes)}
    with GGUFFile(gemma3_path) as gguf:
        halda = HaldaOptions(ModelProfile.from_gguf(gguf, ctx_tokens=PLANNED_CTX))
        fingerprint = gguf.fingerprint()
    watch = AdvertWatch()
    spec = RingSpec(tuple(local.addresses), halda, discover=partial(advertised, watch, fingerprint))
    ring = FailoverRing(Ring.connect(local.addresses, halda=halda, timeout_s=CONNECT_TIMEOUT_S), spec)
    comeback: LocalRing | None = None
    try:
        assert len(ring.plan.nodes) >= 3  # no two nodes hold 18 layers in 2 x 7
        follower = ring.plan.nodes[-1].node_id
        at = random.Random(6).randrange(4, 48)
        events = _run(ring, _request(prompt, MAX_TOKENS, logits=True), local, index[follower], at)
        done = events.pop()
        assert isinstance(done, GenerationDone)
        assert events == expected
        assert len(ring.recoveries) == 1
        assert ring.recoveries[0].at_token >= at + 1
        assert follower not in {n.node_id for n in ring.plan.nodes}
        assert math.isfinite(ring.plan.predicted_ms_per_token)  # Halda's plan, not an even split
        assert ring.ring.devices  # planned from the survivors' profiles
        assert done.prompt_logits is not None
        assert np.abs(np.asarray(done.prompt_logits) - want_logits).max() <= F32_TOLERANCE

        # The head dies mid-generation; the two nodes left hold 14 of the 18 layers.
        head = ring.plan.head.node_id
        alive = [n for n in local.nodes if n.node_id not in (follower, head)]
        at = random.Random(7).randrange(2, 8)
        with pytest.raises(
            NodeError, match=r"could not recover: no assignment of 18 layers fits.*add a device"
        ):
            _run(ring, _request(prompt, MAX_TOKENS), local, index[head], at)
        assert all(_sessions(n.address) == 0 for n in alive)

        # The follower comes back on a new port: the next generation's re-plan finds it.
        comeback = LocalRing.start(
            1,
            gemma3_path,
            threads=1,
            log_dir=ring_logs / "gemma-halda-comeback",
            names=[follower],
            mem_budgets=[BUDGET],
            extra_args=("--exact",),
            mdns=True,
        )
        _wait_until_advertised(watch, comeback.addresses[0])
        events = list(ring.generate(_request(prompt, 8)))
        assert events[:-1] == expected[:8]
        assert comeback.addresses[0] in {n.address for n in ring.plan.nodes}
        assert all(info.sessions == 0 for info in ring.info())
    finally:
        ring.close()
        watch.close()
        if comeback is not None:
            comeback.close()
