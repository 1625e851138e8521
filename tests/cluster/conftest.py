"""Local rings of real primad processes, shared per module, and the single-device reference."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, GenerationDone, generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.net import discovery
from prima.scheduler.profile_cache import CACHE_ENV

N_CTX = 512  # the oracle's long prompts have ~310 tokens
UBATCH = 4  # small, so prompts are cut into several micro-batches that pipeline round the ring
MAX_TOKENS = 10
GREEDY = SamplerConfig()


def reference_tokens(model_path: Path, prompt_ids: Sequence[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens from the single-device engine with the ring's micro-batch size."""
    loaded = load_model(model_path, mode="exact")
    engine = LocalEngine(loaded.model, n_ctx=N_CTX, ubatch=UBATCH)
    stops = sorted(loaded.tokenizer.stop_ids)
    return generate(engine, prompt_ids, max_tokens=max_tokens, sampler=GREEDY, stop_ids=stops).token_ids


def ring_request(
    prompt_ids: Sequence[int],
    max_tokens: int = MAX_TOKENS,
    stop_ids: Sequence[int] = (),
    *,
    ubatch: int = UBATCH,
    want_prompt_logits: bool = False,
    keep_session: bool = False,
) -> GenerateRequest:
    """A greedy request with the tests' context and micro-batch size."""
    return GenerateRequest(
        tuple(prompt_ids),
        max_tokens,
        GREEDY,
        tuple(stop_ids),
        n_ctx=N_CTX,
        ubatch=ubatch,
        want_prompt_logits=want_prompt_logits,
        keep_session=keep_session,
    )


def ring_tokens(
    ring: Ring, prompt_ids: Sequence[int], max_tokens: int = MAX_TOKENS, **kwargs: object
) -> list[int]:
    """The token ids the head samples for a greedy request; checks the stream ends with its
    GenerationDone."""
    events = list(ring.generate(ring_request(prompt_ids, max_tokens, **kwargs)))  # type: ignore[arg-type]
    assert isinstance(events[-1], GenerationDone)
    return [t for t in events if isinstance(t, int)]


@pytest.fixture(scope="module")
def mdns_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A private service type and profile cache, for this process and the daemons it starts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(discovery.SERVICE_TYPE_ENV, f"_pr{secrets.token_hex(4)}._tcp.local.")
        mp.setenv(discovery.INTERFACES_ENV, "127.0.0.1")
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("profiles")))
        yield


@pytest.fixture(scope="module")
def ring_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("primad-logs")


def start_ring(n: int, model: Path, log_dir: Path, **kwargs: object) -> Iterator[LocalRing]:
    # Exact mode on both sides: the ring must reproduce llama.cpp's float32 numerics.
    kwargs.setdefault("extra_args", ("--exact",))
    ring = LocalRing.start(n, model, threads=1, log_dir=log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield ring
    finally:
        ring.close()
