"""Ring.stream: tokens sampled on the head become text on the coordinator, with the same stop
rules as the local generation loop. The head is a fake token source; no sockets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from prima.cluster.coordinator import Ring
from prima.engine.generate import GenerationResult
from prima.engine.sampling import SamplerConfig
from prima.errors import InputError
from prima.net.client import GenerateDone
from prima.scheduler.plan import plan_from_window_sizes

WORDS = {1: "Hello", 2: ",", 3: " world", 4: "!", 5: " STOP", 6: " more"}


class Letters:
    """A TextDecoder over WORDS."""

    def feed(self, token_id: int) -> str:
        return WORDS[token_id]

    def flush(self) -> str:
        return ""


class FakeHead:
    def __init__(self, tokens: Sequence[int], stop_reason: str = "eos") -> None:
        self.tokens = tokens
        self.stop_reason = stop_reason
        self.sent = 0
        self.closed = False
        self.max_tokens = -1

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, **_: object) -> Iterator[object]:
        self.max_tokens = max_tokens
        try:
            for t in self.tokens:
                self.sent += 1
                yield t
            yield GenerateDone(self.stop_reason, 1.0, 2.0)
        finally:
            self.closed = True


def _ring(head: FakeHead) -> Ring:
    ring = Ring([], plan_from_window_sizes([("h", "h:1")], [2], 1, 2))
    ring.generate = head.generate  # type: ignore[method-assign]
    return ring


def _run(ring: Ring, **kwargs: object) -> tuple[list[str], GenerationResult]:
    args: dict[str, object] = {
        "max_tokens": 10,
        "sampler": SamplerConfig(),
        "n_ctx": 64,
        "decoder": Letters(),
    }
    args.update(kwargs)
    pieces: list[str] = []
    for event in ring.stream([7, 8], **args):  # type: ignore[arg-type]
        if isinstance(event, GenerationResult):
            return pieces, event
        pieces.append(event)
    raise AssertionError("no result")


def test_stream_decodes_the_heads_tokens_and_keeps_its_stop_reason() -> None:
    head = FakeHead([1, 2, 3, 4])
    pieces, result = _run(_ring(head))
    assert "".join(pieces) == result.text == "Hello, world!"
    assert result.token_ids == [1, 2, 3, 4]
    assert result.prompt_token_ids == [7, 8]
    assert result.stop_reason == "eos"
    assert result.timings.generated_tokens == 4


def test_stream_stops_at_a_stop_string_and_cancels_the_head() -> None:
    head = FakeHead([1, 3, 5, 6, 6, 6])
    pieces, result = _run(_ring(head), stop_strings=[" ST"])
    assert result.text == "Hello world"
    assert "".join(pieces) == "Hello world"
    assert result.stop_reason == "stop_string"
    assert head.sent == 3
    assert head.closed


def test_stream_caps_tokens_at_the_context_and_refuses_long_prompts() -> None:
    head = FakeHead([1])
    _run(_ring(head), n_ctx=5)
    assert head.max_tokens == 3
    with pytest.raises(InputError, match="context holds 2"):
        _run(_ring(FakeHead([1])), n_ctx=2)
