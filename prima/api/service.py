"""Turn a parsed request into a generation (or an embedding) on the one Generator (this device
or a ring), up to `--parallel` requests at a time.

Generations are serialized through a FIFO queue. A request whose client has gone (or a server
that is shutting down) stops at the next token: before each token the service asks
`cancelled()` and, if so, closes the generation, which frees the generator for the next
request without waiting for `max_tokens` (on a ring, the head ends the generation too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from prima import metrics
from prima.api.embeddings import EmbeddingsRequest, Pooling, pool
from prima.api.openai_schema import GenerationRequest, ModelNotFoundError, RequestError
from prima.engine.generate import (
    GenerateRequest,
    GenerationDone,
    GenerationResult,
    Generator,
    TokenEvent,
    stream_text,
)
from prima.engine.prompt import chat_prompt_ids, prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.errors import GenerationCancelled, InputError, NodeError, PrimaError, ProtocolError
from prima.model.files import ModelFiles

log = logging.getLogger("prima.api")

Cancelled = Callable[[], bool]


class ServerBusyError(PrimaError):
    """Too many requests are already waiting for the engine; the client should retry later."""


class ServerStoppingError(PrimaError):
    """The server is stopping (SIGTERM, Ctrl-C): a new or queued request is refused (`cut`
    False), or a running generation was ended at the shutdown deadline (`cut` True)."""

    def __init__(self, message: str, *, cut: bool) -> None:
        super().__init__(message)
        self.cut = cut


def request_outcome(exc: BaseException) -> str:
    """The `outcome` label of prima_requests_total for a request that ended in `exc`: one of
    metrics.REQUEST_OUTCOMES, never a class name (those change with the code)."""
    if isinstance(exc, GenerationCancelled | GeneratorExit | ServerStoppingError):
        return "cancelled"  # the client went away, or the server is stopping
    if isinstance(exc, ServerBusyError):
        return "busy"
    if isinstance(exc, InputError):
        return "bad_request"
    if isinstance(exc, NodeError):
        return "node_lost"
    return "error"


class EngineQueue:
    """A FIFO of `slots` places: up to `slots` requests generate at once (`prima serve
    --parallel`), the rest wait, and whoever waits longest gets the next free place. At most
    `max_waiting` requests wait; a waiter gives up when `cancelled()` turns true or after
    `timeout_s` seconds."""

    def __init__(self, max_waiting: int = 16, poll_s: float = 0.1, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.max_waiting = max_waiting
        self.poll_s = poll_s
        self.slots = slots
        self._mutex = threading.Lock()
        self._running = 0
        self._waiters: deque[threading.Event] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def running(self) -> int:
        return self._running

    @property
    def busy(self) -> bool:
        """Every place is taken: a new request would wait."""
        return self._running >= self.slots

    def acquire(self, cancelled: Cancelled, timeout_s: float) -> None:
        """Block until this caller has a place; raise ServerBusyError or GenerationCancelled."""
        with self._mutex:
            if self._running < self.slots and not self._waiters:
                self._running += 1
                return
            if len(self._waiters) >= self.max_waiting:
                raise ServerBusyError(
                    f"{len(self._waiters)} requests are already waiting for the model; retry later"
                )
            turn = threading.Event()
            self._waiters.append(turn)
        deadline = time.monotonic() + timeout_s
        while not turn.wait(self.poll_s):
            gone = cancelled()
            if gone or time.monotonic() >= deadline:
                with self._mutex:
                    if not turn.is_set():  # still queued: leave the queue
                        self._waiters.remove(turn)
                        if gone:
                            raise GenerationCancelled("the client disconnected while queued")
                        raise ServerBusyError(
                            f"waited {timeout_s:.0f} s for the model without a turn; retry later"
                        )
                # Handed a place in the same instant: we own it, so carry on.
                break

    def release(self) -> None:
        """Hand the place straight to the longest waiter, so no late arrival can jump the queue."""
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()  # the place passes on: _running stays
            else:
                self._running -= 1


def _watched(events: Iterator[TokenEvent], cancelled: Cancelled, cut: Cancelled) -> Iterator[TokenEvent]:
    """`events`, ended between two tokens with GenerationCancelled as soon as `cancelled()`
    turns true (the client went away), or with ServerStoppingError once `cut()` does; the time
    between tokens goes to the per-token latency histogram."""
    try:
        t = None
        while True:
            if cut():
                raise ServerStoppingError(
                    "the server is shutting down and ended this generation before it finished; "
                    "retry the request",
                    cut=True,
                )
            if cancelled():
                raise GenerationCancelled("generation cancelled: the client disconnected")
            event = next(events, None)
            if event is None:
                return
            now = time.perf_counter()
            if t is not None and not isinstance(event, GenerationDone):
                metrics.TOKEN_LATENCY.observe(now - t)
            t = now
            yield event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class ServeDefaults:
    """What a request gets for fields it leaves out (from `prima serve`'s flags)."""

    sampler: SamplerConfig = SamplerConfig(temperature=0.7)
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    queue_timeout_s: float = 600.0
    draft: DraftConfig = DraftConfig()


@dataclass(frozen=True)
class PreparedGeneration:
    """A request resolved against the model: tokens, sampler and limits, ready for the engine."""

    prompt_ids: list[int]
    sampler: SamplerConfig
    max_tokens: int
    stop_strings: tuple[str, ...]


class CompletionService:
    """Owns the loaded model and its generator; the HTTP layer calls `prepare` then `run`."""

    def __init__(
        self,
        loaded: ModelFiles,
        generator: Generator,
        model_id: str,
        n_ctx: int,
        defaults: ServeDefaults | None = None,
        queue: EngineQueue | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.loaded = loaded
        self.chat_template = chat_template  # None: the model's own (or its fallback)
        self.generator = generator
        self.n_ctx = n_ctx
        self.model_id = model_id
        self.defaults = defaults or ServeDefaults()
        self.queue = queue or EngineQueue()
        self.created = int(time.time())
        self._stopping = threading.Event()
        self._closing = threading.Event()

    def stop_taking_work(self) -> None:
        """Refuse new requests, and those waiting in the queue, with ServerStoppingError; the
        running generations go on."""
        self._stopping.set()

    def close(self) -> None:
        """Stop taking work, and end the running generations at their next token
        (ServerStoppingError)."""
        self._stopping.set()
        self._closing.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def prepare(self, req: GenerationRequest) -> PreparedGeneration:
        """Tokenize and check the request before it queues, so bad input never waits for the engine.
        A request may leave `model` out (the server runs one); if it names one, it must be ours,
        so a client pointed at the wrong server learns so instead of getting another model's text."""
        if req.model is not None and req.model != self.model_id:
            raise ModelNotFoundError(req.model, self.model_id)
        tok = self.loaded.tokenizer
        if req.kind == "chat":
            ids = chat_prompt_ids(
                self.loaded.gguf.metadata,
                tok,
                [m.as_template_input() for m in req.messages],
                self.chat_template,
            )
        elif isinstance(req.prompt, str):
            ids = prompt_ids(tok, req.prompt)
        else:
            assert req.prompt is not None, "parse_completion_request guarantees a prompt"
            ids = list(req.prompt)
            bad = [t for t in ids if t >= tok.vocab_size]
            if bad:
                raise RequestError(
                    f"'prompt' has token ids outside the vocabulary of {tok.vocab_size}: {bad[:5]}", "prompt"
                )
        if len(ids) >= self.n_ctx:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or restart the server with a larger --ctx",
                "messages" if req.kind == "chat" else "prompt",
            )
        return PreparedGeneration(
            prompt_ids=ids,
            sampler=_merge_sampler(self.defaults.sampler, req),
            max_tokens=req.max_tokens if req.max_tokens is not None else self.defaults.max_tokens,
            stop_strings=_merge_stops(self.defaults.stop, req.stop),
        )

    def run(self, prep: PreparedGeneration, cancelled: Cancelled) -> Iterator[str | GenerationResult]:
        """Wait for the generator, then yield text pieces and finally the GenerationResult.

        The engine is released when the iterator finishes, raises, or is closed early, so a
        caller that stops iterating (a broken pipe) frees it too."""

        t0 = time.perf_counter()
        self._acquire(cancelled)
        released = False
        first = True
        outcome = "cancelled"
        try:
            tok = self.loaded.tokenizer
            request = GenerateRequest(
                tuple(prep.prompt_ids),
                prep.max_tokens,
                prep.sampler,
                tuple(sorted(tok.stop_ids)),
                n_ctx=self.n_ctx,
                draft=self.defaults.draft,
                # A server's requests often continue each other (chats, a shared system prompt).
                keep_session=True,
            )
            events = _watched(self.generator.generate(request), cancelled, lambda: self.closing)
            for event in stream_text(
                events, prep.prompt_ids, stop_strings=prep.stop_strings, decoder=tok.stream_decoder()
            ):
                if first:
                    metrics.TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - t0)
                    first = False
                if isinstance(event, GenerationResult):
                    # Free the engine before the reply is written, so the next request (or a
                    # /health check right after this reply) finds it idle.
                    self.queue.release()
                    released = True
                    outcome = "ok"
                    metrics.PROMPT_TOKENS.inc(event.timings.prompt_tokens)
                    metrics.PROMPT_CACHED_TOKENS.inc(event.timings.cached_tokens)
                    metrics.GENERATED_TOKENS.inc(event.timings.generated_tokens)
                yield event
        except BaseException as exc:
            if outcome != "ok":  # a client closing the stream after the result still got it all
                outcome = request_outcome(exc)
            raise
        finally:
            metrics.REQUESTS.labels(outcome).inc()
            if not released:
                self.queue.release()

    def prepare_embeddings(self, req: EmbeddingsRequest) -> list[list[int]]:
        """The token ids of each input, checked before the request queues."""
        if req.model is not None and req.model != self.model_id:
            raise ModelNotFoundError(req.model, self.model_id)
        tok = self.loaded.tokenizer
        d_model = self.loaded.weights.config.d_model
        if req.dimensions is not None and req.dimensions != d_model:
            raise RequestError(
                f"'dimensions' {req.dimensions} is not available: this model's embeddings have "
                f"{d_model}; leave 'dimensions' out",
                "dimensions",
            )
        prompts = []
        for i, item in enumerate(req.inputs):
            ids = prompt_ids(tok, item) if isinstance(item, str) else list(item)
            bad = [t for t in ids if t >= tok.vocab_size]
            if bad:
                raise RequestError(
                    f"'input[{i}]' has token ids outside the vocabulary of {tok.vocab_size}: {bad[:5]}",
                    "input",
                )
            if len(ids) >= self.n_ctx:
                raise RequestError(
                    f"'input[{i}]' has {len(ids)} tokens but the context holds {self.n_ctx}; "
                    "shorten it or restart the server with a larger --ctx",
                    "input",
                )
            prompts.append(ids)
        return prompts

    def embed(self, prompts: Sequence[list[int]], pooling: Pooling, cancelled: Cancelled) -> Embeddings:
        """Wait for the generator, then run each prompt for its hidden states and pool them
        (prima.api.embeddings); one place in the queue serves every input of the request."""

        self._acquire(cancelled)
        outcome = "cancelled"
        try:
            vectors = []
            for ids in prompts:
                if self.closing:
                    raise ServerStoppingError(
                        "the server is shutting down and ended this request before it finished; retry it",
                        cut=True,
                    )
                if cancelled():
                    raise GenerationCancelled("embedding cancelled: the client disconnected")
                request = GenerateRequest(tuple(ids), 0, n_ctx=self.n_ctx, want_hidden_states=True)
                done = _last_event(self.generator.generate(request))
                if done.hidden_states is None:
                    raise ProtocolError("the generator returned no hidden states for an embedding request")
                vectors.append(pool(done.hidden_states, pooling))
            outcome = "ok"
            n_tokens = sum(len(ids) for ids in prompts)
            metrics.PROMPT_TOKENS.inc(n_tokens)
            return Embeddings(vectors, n_tokens)
        except BaseException as exc:
            outcome = request_outcome(exc)
            raise
        finally:
            metrics.REQUESTS.labels(outcome).inc()
            self.queue.release()

    def check_taking_work(self) -> None:
        """ServerStoppingError once the server is stopping."""
        if self.stopping:
            raise _refused()

    def _acquire(self, cancelled: Cancelled) -> None:
        """A place in the queue (counted in the queue-depth gauge while waiting for it); a
        request that comes or waits while the server is stopping is refused."""
        if self.stopping:
            metrics.REQUESTS.labels("cancelled").inc()
            raise _refused()
        metrics.QUEUE_DEPTH.inc()
        try:
            self.queue.acquire(lambda: self.stopping or cancelled(), self.defaults.queue_timeout_s)
        except GenerationCancelled:
            metrics.REQUESTS.labels("cancelled").inc()
            if self.stopping:
                raise _refused() from None
            raise
        except PrimaError as exc:
            metrics.REQUESTS.labels(request_outcome(exc)).inc()
            raise
        finally:
            metrics.QUEUE_DEPTH.dec()


def _refused() -> ServerStoppingError:
    return ServerStoppingError(
        "the server is shutting down and takes no new requests; retry on another server or once it is back",
        cut=False,
    )


@dataclass(frozen=True)
class Embeddings:
    """One unit vector per input, and the tokens they took."""

    vectors: list[np.ndarray]
    prompt_tokens: int


def final_result(events: Iterator[str | GenerationResult]) -> GenerationResult:
    """The GenerationResult that ends CompletionService.run's events, the text before it read
    and dropped (a request that is not streamed)."""
    for event in events:
        if isinstance(event, GenerationResult):
            return event
    raise AssertionError("CompletionService.run always ends with a GenerationResult")


def _last_event(events: Iterator[TokenEvent]) -> GenerationDone:
    """The GenerationDone that ends `events` (a prompt-only request yields nothing before it)."""
    try:
        for event in events:
            if isinstance(event, GenerationDone):
                return event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    raise ProtocolError("the generation ended without its last event")


def _merge_sampler(base: SamplerConfig, req: GenerationRequest) -> SamplerConfig:
    """The server's sampler with whatever the request set; SamplerConfig re-validates the result."""
    s = req.sampling
    changes = {
        name: value
        for name, value in (
            ("temperature", s.temperature),
            ("top_p", s.top_p),
            ("top_k", s.top_k),
            ("min_p", s.min_p),
            ("repeat_penalty", s.repeat_penalty),
            ("seed", s.seed),
        )
        if value is not None
    }
    return replace(base, **changes)


def _merge_stops(server: Sequence[str], request: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*server, *request]))
