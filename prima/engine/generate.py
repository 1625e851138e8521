"""The generation loop: prefill the prompt, then sample token by token until a stop.

It runs on any engine with `forward(ids) -> last logits` (this device, or a ring of daemons),
so the single-device engine and the ring share one loop and one sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from prima.engine.draft_choice import drafter
from prima.engine.drafts_ahead import drafts_ahead
from prima.engine.prefix import reuse_prefix
from prima.engine.sampling import Sampler, SamplerConfig
from prima.engine.speculative import DraftConfig, DraftLength, DraftSource
from prima.errors import ContextFullError, InputError


class Engine(Protocol):
    n_ctx: int

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray: ...

    def hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Like `forward`, but every token's final normed hidden state (n, d_model), the
        input of the output head: what embeddings are pooled from."""
        ...

    def reset(self) -> None: ...


@runtime_checkable
class VerifyingEngine(Engine, Protocol):
    """An engine that can check draft tokens (speculative decoding): `forward_all` returns the
    logits of every token (n, vocab), each bit for bit what `forward` would give token by token;
    `rewind(n_past)` forgets every position from `n_past` on (the rejected drafts)."""

    def forward_all(self, token_ids: list[int] | np.ndarray) -> np.ndarray: ...

    def rewind(self, n_past: int) -> None: ...


@runtime_checkable
class ReplayingEngine(Protocol):
    """An engine that can feed tokens as decoding fed them: `forward_decoded` returns the last
    token's logits, bit for bit what `forward` token by token gives, and leaves the cache with
    the same bits, in batches as large as keeps that true (a resumed generation's tokens)."""

    def forward_decoded(self, token_ids: list[int] | np.ndarray) -> np.ndarray: ...


class TextDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass
class Timings:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those whose KV was kept from an earlier request
    prompt_ms: float = 0.0
    generated_tokens: int = 0
    generate_ms: float = 0.0
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and of those accepted
    accepted_tokens: int = 0
    draft_off: str = ""  # why the drafts asked for were not made as asked ("" = they were)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed (the cached ones were not) per second of prompt time."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / (self.prompt_ms / 1000) if self.prompt_ms else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes from the prefill's logits; decode steps are the rest.
        steps = max(self.generated_tokens - 1, 0)
        return steps / (self.generate_ms / 1000) if self.generate_ms and steps else 0.0

    @property
    def ms_per_token(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return self.generate_ms / steps if steps else 0.0

    def as_dict(self) -> dict[str, float | str]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "generated_tokens": self.generated_tokens,
            "generate_ms": round(self.generate_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "ms_per_token": round(self.ms_per_token, 3),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_off": self.draft_off,
        }


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""  # "eos", "stop_string", "length"
    timings: Timings = field(default_factory=Timings)
    prompt_logits: np.ndarray | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One generation as every path takes it, on this device or on a ring's head: what to
    continue, how far, how to sample, where to stop. `want_prompt_logits` asks for the prompt's
    last-token logits once, with the end of the generation (`prima run --logits-out`).
    `first_step` > 0 resumes a generation whose first `first_step` tokens end the prompt (after
    a failover): they are fed as decoding fed them (`prefill`) and a seeded sampler continues at
    that draw, so the output equals the unbroken run's.
    `draft` turns on speculative decoding (the output is the same; only its speed changes).
    `want_hidden_states` runs the prompt only (max_tokens must be 0) and returns every prompt
    token's final normed hidden state with the GenerationDone: the rows embeddings pool.
    `keep_session` asks a ring's head to keep the session's KV on every node after a good end,
    so that a request continuing it (a chat's next turn) sends only its new tokens; a one-shot
    run leaves it off, and the session's memory is freed at once."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    stop_ids: tuple[int, ...] = ()
    n_ctx: int = 2048
    ubatch: int = 0  # prompt micro-batch size in tokens; 0 = the engine's default
    want_prompt_logits: bool = False
    first_step: int = 0
    draft: DraftConfig = field(default_factory=DraftConfig)
    want_hidden_states: bool = False
    keep_session: bool = False


@dataclass(frozen=True)
class GenerationDone:
    """The last event of a generation: why it stopped, the sampling side's timings, and how
    many draft tokens were checked and kept (speculative decoding)."""

    stop_reason: str  # "eos" or "length"; stop strings are matched where the text is decoded
    prompt_ms: float
    generate_ms: float
    prompt_logits: np.ndarray | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    hidden_states: np.ndarray | None = None  # (n_prompt, d_model), when asked for
    draft_off: str = ""  # why the drafts asked for were not made as asked ("" = they were)
    cached_tokens: int = 0  # prompt tokens whose KV an earlier request left (not computed again)


TokenEvent = int | GenerationDone


class Generator(Protocol):
    """Anything that runs a GenerateRequest: this device (LocalGenerator, LocalGeneratorPool) or
    a ring (the coordinator's Ring, the head daemon). It yields token ids as they are sampled,
    then one GenerationDone; closing the iterator early cancels the generation. The context a
    request may use travels in the request (GenerateRequest.n_ctx)."""

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]: ...


def sample_tokens(
    engine: Engine,
    request: GenerateRequest,
    clock: Callable[[], float] = time.perf_counter,
    draft_model: DraftSource | None = None,
) -> Iterator[TokenEvent]:
    """The generation loop: prefill the prompt, then sample and decode until a stop id or the
    token budget. The one place tokens are sampled, on whatever engine runs the layers;
    `draft_model` is the draft model where it runs (for `--draft model`), if any.

    With a draft (request.draft), each pass feeds the last token and up to k draft tokens and
    gets logits for all of them (engine.forward_all). Every position is still sampled from its
    own logits, with its own step's randomness, as plain decoding samples it; a draft token is
    kept while it equals that sample, and the first sample that differs is the next token. So
    the output is plain decoding's, greedy or seeded, token for token. For temperature > 0 this
    is the standard speculative rule for a draft that proposes one token with certainty (accept
    with probability p(draft), else draw from p without it), with the randomness of plain
    decoding's draws."""
    prompt, max_tokens = check_prompt(request.prompt_ids, request.max_tokens, engine.n_ctx)
    if request.want_hidden_states:
        yield prompt_hidden_states(engine, prompt, max_tokens, clock)
        return
    sample = Sampler(request.sampler, request.first_step)
    drafts_from = drafter(request.draft, engine.n_ctx, draft_model)
    draft_length = DraftLength(request.draft.max_tokens)
    if drafts_from is not None and not isinstance(engine, VerifyingEngine):
        raise InputError(f"{type(engine).__name__} cannot check draft tokens; run without --draft")
    ahead = drafts_ahead(drafts_from, request.draft, engine)  # on a ring, with a draft model
    stops = set(request.stop_ids)
    history = list(prompt)
    t0 = clock()
    cached = reuse_prefix(engine, prompt)
    logits = prefill(engine, prompt[cached:], request.first_step)
    prompt_logits = logits if request.want_prompt_logits else None
    t1 = clock()
    stop_reason = "length"
    drafted = accepted = 0
    token = sample.sample(logits, history) if max_tokens else -1
    while max_tokens:
        if token in stops:
            stop_reason = "eos"
            break
        history.append(token)
        yield token
        left = max_tokens - (len(history) - len(prompt))
        if not left:
            break
        n_drafts = draft_length.next(left - 1) if drafts_from else 0
        drafts = ahead.take(history, n_drafts) if ahead else []
        drafts = drafts or (drafts_from.propose(history, n_drafts) if drafts_from else [])
        if not drafts:
            token = sample.sample(engine.forward([token]), history)
            continue
        verifier: VerifyingEngine = engine  # type: ignore[assignment]  # checked above
        rows = (
            ahead.check(verifier.forward_all, history, drafts)
            if ahead
            else verifier.forward_all([token, *drafts])
        )
        drafted += len(drafts)
        kept = 0
        for row, draft in zip(rows, [*drafts, None], strict=True):
            token = sample.sample(row, history)
            if token != draft or token in stops:
                break
            history.append(token)
            kept += 1
            yield token
        accepted += kept
        draft_length.record(len(drafts), kept)
        # Positions hold the context's tokens up to here; the rest were rejected drafts.
        verifier.rewind(len(history))
    yield GenerationDone(
        stop_reason,
        (t1 - t0) * 1000,
        (clock() - t1) * 1000,
        prompt_logits,
        drafted,
        accepted,
        cached_tokens=cached,
    )


def prefill(engine: Engine, prompt: list[int], decoded: int = 0) -> np.ndarray:
    """Feed `prompt` to `engine` (reset, or holding what comes before it); the last token's
    logits. Its last `decoded` tokens are a resumed generation's, sampled before it stopped (a
    failover): the rest of the prompt goes in as the first run's prefill did, and those tokens
    as decoding fed them, so the KV cache and every later logit have the unbroken run's bits
    (batched prefill computes in another order than decode: in q8 mode its logits differ by up
    to ~1)."""
    split = len(prompt) - min(max(decoded, 0), len(prompt) - 1)
    logits = engine.forward(prompt[:split])
    rest = prompt[split:]
    if not rest:
        return logits
    if isinstance(engine, ReplayingEngine):
        return engine.forward_decoded(rest)
    for token in rest:
        logits = engine.forward([token])
    return logits


def prompt_hidden_states(
    engine: Engine, prompt: list[int], max_tokens: int, clock: Callable[[], float] = time.perf_counter
) -> GenerationDone:
    """The prompt run for its hidden states (an embedding): nothing is sampled."""
    if max_tokens:
        raise InputError("a request for hidden states generates nothing: set max_tokens to 0")
    engine.reset()
    t0 = clock()
    hidden = engine.hidden_states(prompt)
    return GenerationDone("length", (clock() - t0) * 1000, 0.0, hidden_states=hidden)


class LocalGenerator:
    """A Generator over one engine on this device (one request at a time: it holds one cache),
    drafting with `draft_model` when a request asks for a draft model."""

    def __init__(self, engine: Engine, draft_model: DraftSource | None = None) -> None:
        self.engine = engine
        self.n_ctx = engine.n_ctx
        self.draft_model = draft_model

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        return sample_tokens(self.engine, request, draft_model=self.draft_model)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def stream_text(
    events: Iterator[TokenEvent],
    prompt_ids: Sequence[int],
    *,
    stop_strings: Sequence[str] = (),
    decoder: TextDecoder | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[str | GenerationResult]:
    """Token events as the user sees them: text pieces as they become valid UTF-8 (a stop string
    is never shown and ends the generation, closing `events`), then the GenerationResult. The
    timings are this side's: the prompt time runs until the first event arrives."""
    result = GenerationResult(prompt_token_ids=[int(t) for t in prompt_ids], stop_reason="length")
    text = StopText(decoder, stop_strings)
    t0 = clock()
    t1: float | None = None
    try:
        for event in events:
            if t1 is None:
                t1 = clock()  # the prompt has run and the first token is sampled
            if isinstance(event, GenerationDone):
                result.stop_reason = event.stop_reason
                result.prompt_logits = event.prompt_logits
                result.timings.draft_tokens = event.draft_tokens
                result.timings.accepted_tokens = event.accepted_tokens
                result.timings.draft_off = event.draft_off
                result.timings.cached_tokens = event.cached_tokens
                break
            result.token_ids.append(int(event))
            piece = text.feed(int(event))
            if piece:
                yield piece
            if text.stopped:
                result.stop_reason = "stop_string"
                break
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()  # cancels a generation that is still going (on a ring: on the head)
    tail = text.finish()
    if tail:
        yield tail
    t2 = clock()
    t1 = t2 if t1 is None else t1
    result.text = text.text
    result.timings.prompt_tokens = len(result.prompt_token_ids)
    result.timings.prompt_ms = (t1 - t0) * 1000
    result.timings.generated_tokens = len(result.token_ids)
    result.timings.generate_ms = (t2 - t1) * 1000
    yield result


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
    """Generate on one engine and return the result (the prompt's logits included); call
    `on_text` with each new piece of valid UTF-8 text."""
    request = GenerateRequest(
        tuple(int(t) for t in prompt_ids),
        max_tokens,
        sampler,
        tuple(int(t) for t in stop_ids),
        n_ctx=engine.n_ctx,
        want_prompt_logits=True,
    )
    return collect(
        stream_text(
            sample_tokens(engine, request, clock),
            request.prompt_ids,
            stop_strings=stop_strings,
            decoder=decoder,
            clock=clock,
        ),
        on_text,
    )


def collect(
    events: Iterator[str | GenerationResult], on_text: Callable[[str], None] | None = None
) -> GenerationResult:
    """Drain `stream_text`'s events, handing text to `on_text`; the GenerationResult."""
    for event in events:
        if isinstance(event, GenerationResult):
            return event
        if on_text:
            on_text(event)
    raise AssertionError("stream_text always ends with a GenerationResult")


def forward_ids(token_ids: list[int] | np.ndarray, n_past: int, n_ctx: int) -> np.ndarray:
    """The ids of one forward call as int64, checked against the room left in the context (an
    engine holding `n_past` of `n_ctx` positions)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size == 0:
        raise InputError("nothing to compute: the token list is empty")
    if n_past + ids.size > n_ctx:
        raise ContextFullError(
            f"{n_past + ids.size} tokens do not fit the context of {n_ctx}; "
            "shorten the prompt, lower -n, or raise --ctx"
        )
    return ids


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
