"""The generation loop: prefill the prompt, then sample token by token until a stop.

It runs on any engine with `forward(ids) -> last logits` (this device, or a ring of daemons),
so the single-device engine and the ring share one loop and one sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from prima.engine.sampling import Sampler, SamplerConfig
from prima.errors import InputError


class Engine(Protocol):
    n_ctx: int

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray: ...

    def reset(self) -> None: ...


class TextDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    generated_tokens: int = 0
    generate_ms: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / (self.prompt_ms / 1000) if self.prompt_ms else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes from the prefill's logits; decode steps are the rest.
        steps = max(self.generated_tokens - 1, 0)
        return steps / (self.generate_ms / 1000) if self.generate_ms and steps else 0.0

    @property
    def ms_per_token(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return self.generate_ms / steps if steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "generated_tokens": self.generated_tokens,
            "generate_ms": round(self.generate_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "ms_per_token": round(self.ms_per_token, 3),
        }


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""  # "eos", "stop_string", "length"
    timings: Timings = field(default_factory=Timings)
    prompt_logits: np.ndarray | None = None


def generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    sampler: SamplerConfig,
    stop_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decoder: TextDecoder | None = None,
    on_text: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> GenerationResult:
    """Run prefill and decode; call `on_text` with each new piece of valid UTF-8 text."""
    for event in stream(
        engine,
        prompt_ids,
        max_tokens=max_tokens,
        sampler=sampler,
        stop_ids=stop_ids,
        stop_strings=stop_strings,
        decoder=decoder,
        clock=clock,
    ):
        if isinstance(event, str):
            if on_text:
                on_text(event)
        else:
            return event
    raise AssertionError("stream() always ends with a GenerationResult")


def stream(
    engine: Engine,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    sampler: SamplerConfig,
    stop_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decoder: TextDecoder | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[str | GenerationResult]:
    """Yield text pieces as they become valid UTF-8, then the GenerationResult last."""
    prompt, max_tokens = check_prompt(prompt_ids, max_tokens, engine.n_ctx)
    result = GenerationResult(prompt_token_ids=prompt)
    sample = Sampler(sampler)
    stops = set(int(t) for t in stop_ids)
    history = list(prompt)

    engine.reset()
    t0 = clock()
    logits = engine.forward(prompt)
    t1 = clock()
    result.prompt_logits = logits
    result.timings.prompt_tokens = len(prompt)
    result.timings.prompt_ms = (t1 - t0) * 1000
    text = StopText(decoder, stop_strings)
    result.stop_reason = "length"
    for step in range(max_tokens):
        token = sample.sample(logits, history)
        if token in stops:
            result.stop_reason = "eos"
            break
        result.token_ids.append(token)
        history.append(token)
        piece = text.feed(token)
        if piece:
            yield piece
        if text.stopped:
            result.stop_reason = "stop_string"
            break
        if step + 1 < max_tokens:
            logits = engine.forward([token])
    tail = text.finish()
    if tail:
        yield tail
    result.text = text.text
    result.timings.generated_tokens = len(result.token_ids)
    result.timings.generate_ms = (clock() - t1) * 1000
    yield result


def check_prompt(prompt_ids: Sequence[int], max_tokens: int, n_ctx: int) -> tuple[list[int], int]:
    """Validate a prompt against the context; returns it as ints and the tokens that fit after it."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InputError("the prompt is empty: give some text with -p")
    if max_tokens < 0:
        raise InputError(f"-n must be >= 0, got {max_tokens}")
    if len(prompt) >= n_ctx:
        raise InputError(
            f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}; "
            "shorten the prompt or raise --ctx"
        )
    return prompt, min(max_tokens, n_ctx - len(prompt))


class StopText:
    """Decoded text of a generation, cut at the first stop string. `feed` returns only text that
    can no longer turn into a stop string, so a stop string is never streamed to the user."""

    def __init__(self, decoder: TextDecoder | None, stop_strings: Sequence[str]) -> None:
        self.decoder = decoder
        self.stop_strings = stop_strings
        self.text = ""
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def feed(self, token: int) -> str:
        if self.decoder is None or self.stopped:
            return ""
        self.text += self.decoder.feed(token)
        hit = find_stop(self.text, self.stop_strings)
        if hit is not None:
            self.text = self.text[:hit]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - stop_prefix_len(self.text, self.stop_strings))

    def finish(self) -> str:
        """The rest of the text, once generation has ended."""
        if self.decoder is None:
            return ""
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece


def find_stop(text: str, stop_strings: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins, or None."""
    hits = [text.find(s) for s in stop_strings if s and s in text]
    return min(hits) if hits else None


def stop_prefix_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
