"""A chat on a ring of two real primad processes that keep sessions (--keep-sessions): each
turn sends only its new tokens round the ring (the head reports the rest as cached, through
gRPC), the tokens are still those of the whole model on one device, and the session stays
open on every node between turns, one per conversation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerationDone
from prima.engine.prompt import chat_prompt_ids
from prima.forward.loader import load_model

from .conftest import reference_tokens, ring_request, start_ring

pytestmark = pytest.mark.slow

REPLY_TOKENS = 12


@pytest.fixture(scope="module")
def keeping_ring(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(2, smollm2_path, ring_logs / "kept", extra_args=("--exact", "--keep-sessions", "2"))


def test_a_chat_on_a_ring_sends_only_each_turns_new_tokens(
    keeping_ring: LocalRing, smollm2_path: Path
) -> None:
    loaded = load_model(smollm2_path, layers=range(0))
    stops = sorted(loaded.tokenizer.stop_ids)
    history = [{"role": "system", "content": "You answer briefly."}]
    ring = Ring.connect(keeping_ring.addresses, window_sizes=[15, 15])
    try:
        previous = 0
        for question in ("Name a large planet.", "How far is it from the sun?", "And its moons?"):
            history.append({"role": "user", "content": question})
            ids = chat_prompt_ids(loaded.gguf.metadata, loaded.tokenizer, history)
            events = list(ring.generate(ring_request(ids, REPLY_TOKENS, stop_ids=stops, keep_session=True)))
            done = events[-1]
            assert isinstance(done, GenerationDone)
            tokens = [int(t) for t in events[:-1]]
            assert tokens == reference_tokens(smollm2_path, ids, REPLY_TOKENS)
            assert previous <= done.cached_tokens < len(ids)
            assert (done.cached_tokens > 0) == (previous > 0)
            previous = len(ids)
            history.append({"role": "assistant", "content": loaded.tokenizer.decode(tokens)})
            assert [info.sessions for info in ring.info()] == [1, 1]  # kept on both nodes
    finally:
        ring.close()
