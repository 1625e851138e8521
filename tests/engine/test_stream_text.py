"""stream_text: token events from any Generator (a ring's head, this device) become text with the
stop rules of the generation loop; a stop string closes the source, which cancels it. The token
source here is a plain generator; no model, no sockets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from prima.engine.generate import GenerationDone, GenerationResult, TokenEvent, stream_text

WORDS = {1: "Hello", 2: ",", 3: " world", 4: "!", 5: " STOP", 6: " more"}


class Letters:
    """A TextDecoder over WORDS."""

    def feed(self, token_id: int) -> str:
        return WORDS[token_id]

    def flush(self) -> str:
        return ""


class FakeHead:
    """Yields its tokens then a GenerationDone, recording how far it got and whether it was closed."""

    def __init__(self, tokens: Sequence[int], stop_reason: str = "eos") -> None:
        self.tokens = tokens
        self.stop_reason = stop_reason
        self.sent = 0
        self.closed = False

    def events(self) -> Iterator[TokenEvent]:
        try:
            for t in self.tokens:
                self.sent += 1
                yield t
            yield GenerationDone(self.stop_reason, 1.0, 2.0)
        finally:
            self.closed = True


def _run(head: FakeHead, stop_strings: Sequence[str] = ()) -> tuple[list[str], GenerationResult]:
    pieces: list[str] = []
    for event in stream_text(head.events(), [7, 8], stop_strings=stop_strings, decoder=Letters()):
        if isinstance(event, GenerationResult):
            return pieces, event
        pieces.append(event)
    raise AssertionError("no result")


def test_stream_decodes_the_heads_tokens_and_keeps_its_stop_reason() -> None:
    head = FakeHead([1, 2, 3, 4])
    pieces, result = _run(head)
    assert "".join(pieces) == result.text == "Hello, world!"
    assert result.token_ids == [1, 2, 3, 4]
    assert result.prompt_token_ids == [7, 8]
    assert result.stop_reason == "eos"
    assert result.timings.generated_tokens == 4
    assert result.timings.prompt_tokens == 2


def test_stream_stops_at_a_stop_string_and_cancels_the_head() -> None:
    head = FakeHead([1, 3, 5, 6, 6, 6])
    pieces, result = _run(head, stop_strings=[" ST"])
    assert result.text == "Hello world"
    assert "".join(pieces) == "Hello world"
    assert result.stop_reason == "stop_string"
    assert head.sent == 3
    assert head.closed


def test_stream_holds_back_text_that_may_become_a_stop_string() -> None:
    head = FakeHead([1, 3, 6], stop_reason="length")
    pieces, result = _run(head, stop_strings=[" moreX"])
    # " more" could still grow into the stop string until the generation ends.
    assert pieces[-1] == " more"
    assert "".join(pieces) == "Hello world more"
    assert result.stop_reason == "length"


def test_prompt_logits_arrive_with_the_end() -> None:
    logits = np.arange(4, dtype=np.float32)

    def events() -> Iterator[TokenEvent]:
        yield 1
        yield GenerationDone("length", 1.0, 1.0, logits)

    result = list(stream_text(events(), [7], decoder=Letters()))[-1]
    assert isinstance(result, GenerationResult)
    assert result.prompt_logits is not None
    assert np.array_equal(result.prompt_logits, logits)
