"""A whole model on this device: the engine the ring's output is checked against.

When the model is bigger than the memory this process may use (its cgroup's, else the host's),
the layers stream through a bounded buffer instead of thrashing the page cache: some stay pinned,
the rest are read ahead of compute by a prefetch thread (weights.window)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Sequence

import numpy as np

from prima.engine.batching import DecodeBatcher
from prima.engine.generate import (
    Engine,
    GenerateRequest,
    TokenEvent,
    VerifyingEngine,
    forward_ids,
    sample_tokens,
)
from prima.engine.prefix import PrefixEngine, choose_held
from prima.engine.speculative import Drafter, DraftSource
from prima.engine.turns import TurnTaking
from prima.errors import InputError
from prima.forward.loader import LoadedModel
from prima.forward.windowed_model import WindowedModel
from prima.plan import Window
from prima.scheduler.memory import read_memory_limit
from prima.scheduler.profile_schema import ModelProfile
from prima.weights.window import PAGE, LayerWindows, Span, resident_bytes

log = logging.getLogger("prima.engine")

DEFAULT_UBATCH = 128  # prefill dequantizes each weight tile once per micro-batch


class LocalEngine:
    """Runs every layer here. `forward` appends tokens to the session's KV cache and returns the
    logits of the last one; prefill goes in micro-batches of `ubatch` tokens. The cache outlives
    a generation: `held_tokens` says what it holds, so the next request can keep the prefix it
    shares (`rewind`) and compute only the rest."""

    def __init__(
        self,
        model: WindowedModel,
        n_ctx: int,
        ubatch: int = DEFAULT_UBATCH,
        streamer: LayerWindows | None = None,
    ) -> None:
        if n_ctx <= 0:
            raise InputError(f"context size must be positive, got {n_ctx}")
        self.model = model
        self.streamer = streamer
        self.n_ctx = min(n_ctx, model.config.context_length)
        self.ubatch = ubatch
        self.cache = model.new_cache(self.n_ctx)
        self._held: list[int] = []  # the token at each position the cache holds

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def n_past(self) -> int:
        """Positions the cache holds."""
        return len(self._held)

    @property
    def held_tokens(self) -> tuple[int, ...]:
        """The token ids whose keys and values the cache holds, position by position."""
        return tuple(self._held)

    def reset(self) -> None:
        self.cache.truncate(0)
        self._held.clear()

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        return self.model.output_logits(self._run(token_ids, self.ubatch)[-1][-1:])[0]

    def forward_all(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Logits (n, vocab) of every token, computed in batches small enough that each row is
        what `forward` gives the token alone (speculative decoding checks drafts with this)."""
        batch = self.model.backend.batch_identical_tokens
        return np.concatenate([self.model.output_logits(h) for h in self._run(token_ids, batch)])

    def forward_decoded(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """The last token's logits, the tokens computed as decoding computes them, a few per
        batch (replaying a resumed generation's tokens)."""
        batch = self.model.backend.batch_identical_tokens
        return self.model.output_logits(self._run(token_ids, batch)[-1][-1:])[0]

    def rewind(self, n_past: int) -> None:
        """Forget every position from `n_past` on (rejected draft tokens)."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot rewind to {n_past}: the cache holds {self.n_past} positions")
        self.cache.truncate(n_past)
        del self._held[n_past:]

    def count_written(self, token_ids: np.ndarray) -> None:
        """Count `token_ids` as the next positions of the cache, written by a pass that ran
        outside `forward` (the decode batcher's)."""
        self._held.extend(int(t) for t in token_ids)

    def hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        return self.model.output_norm(np.concatenate(self._run(token_ids, self.ubatch)))

    def _run(self, token_ids: list[int] | np.ndarray, ubatch: int) -> list[np.ndarray]:
        """Append the tokens to the cache in micro-batches of `ubatch`; each one's hidden states."""
        ids = forward_ids(token_ids, self.n_past, self.n_ctx)
        m = self.model
        starts = range(0, ids.size, ubatch)
        chunks = [ids[s : s + ubatch] for s in starts]
        positions = [
            np.arange(self.n_past + s, self.n_past + s + c.size) for s, c in zip(starts, chunks, strict=True)
        ]
        hs = [m.embed(chunk) for chunk in chunks]
        if self.streamer is None:
            for i, pos in enumerate(positions):
                hs[i] = m.forward_layers(hs[i], pos, 0, m.config.n_layers, self.cache)
        else:
            # Layer-major, so each streamed layer is read once for the whole prompt; every layer
            # still sees the micro-batches in order, so its cache is written front to back.
            for layer in range(m.config.n_layers):
                self.streamer.before_layer(layer)
                for i, pos in enumerate(positions):
                    hs[i] = m.forward_layers(hs[i], pos, layer, layer + 1, self.cache)
                self.streamer.after_layer(layer)
        self.count_written(ids)
        return hs

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


def local_engine(
    loaded: LoadedModel, n_ctx: int, budget_bytes: int | None = None, ubatch: int = DEFAULT_UBATCH
) -> LocalEngine:
    """The engine for this device. `budget_bytes` caps resident layer weights (None: what the
    cgroup or host leaves now); if the layers do not fit it, they stream."""
    cfg = loaded.model.config
    if budget_bytes is None:
        data = loaded.gguf.data
        limit = read_memory_limit(ours_mapped=resident_bytes(loaded.gguf, Span(0, data.size // PAGE * PAGE)))
        budget_bytes = limit.weights_budget() - ModelProfile.from_gguf(loaded.gguf).head_resident_bytes
        log.info("%s; layer budget %d MiB", limit.describe(), budget_bytes >> 20)
    # One window per layer: the stream buffer then holds two layers, and the rest can be pinned.
    windows = [Window(i, i + 1) for i in range(cfg.n_layers)]
    streamer = (
        LayerWindows(loaded.gguf, loaded.weights, windows, max(budget_bytes, 1)) if budget_bytes else None
    )
    if streamer is not None and not streamer.limited:
        streamer.close()
        streamer = None
    if streamer is not None:
        streamer.release_all()
        streamer.start()
    return LocalEngine(loaded.model, n_ctx=n_ctx, ubatch=ubatch, streamer=streamer)


class _TakingTurns:
    """An engine whose forward passes wait for their turn (TurnTaking); with a batcher, its
    decode steps go through it, batched with other sessions' (prima.engine.batching)."""

    def __init__(self, engine: Engine, turns: TurnTaking, batcher: DecodeBatcher | None = None) -> None:
        self.engine = engine
        self.turns = turns
        self.batcher = batcher if isinstance(engine, LocalEngine) else None
        self.n_ctx = engine.n_ctx

    def reset(self) -> None:
        self.engine.reset()

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        if self.batcher is not None and len(token_ids) == 1:
            assert isinstance(self.engine, LocalEngine)
            return self.batcher.step(self.engine, int(token_ids[0]))
        with self.turns.turn():
            return self.engine.forward(token_ids)

    def forward_all(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        with self.turns.turn():
            return self._verifying().forward_all(token_ids)

    @property
    def held_tokens(self) -> Sequence[int]:
        return self.engine.held_tokens if isinstance(self.engine, PrefixEngine) else ()

    def rewind(self, n_past: int) -> None:
        if isinstance(self.engine, PrefixEngine):
            self.engine.rewind(n_past)
        else:
            self._verifying().rewind(n_past)

    def _verifying(self) -> VerifyingEngine:
        if not isinstance(self.engine, VerifyingEngine):
            raise InputError(f"{type(self.engine).__name__} cannot check draft tokens; run without --draft")
        return self.engine

    def hidden_states(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        with self.turns.turn():
            return self.engine.hidden_states(token_ids)


class _DraftingInTurns:
    """A draft model whose passes, too, wait for their turn (TurnTaking)."""

    def __init__(self, source: DraftSource, turns: TurnTaking) -> None:
        self.source = source
        self.turns = turns

    def drafter(self, n_ctx: int) -> Drafter:
        return _DrafterInTurns(self.source.drafter(n_ctx), self.turns)


class _DrafterInTurns:
    def __init__(self, drafter: Drafter, turns: TurnTaking) -> None:
        self.inner = drafter
        self.turns = turns

    def propose(self, context: Sequence[int], n_tokens: int) -> list[int]:
        if n_tokens <= 0:
            return []
        with self.turns.turn():
            return self.inner.propose(context, n_tokens)


class LocalGeneratorPool:
    """A Generator over up to `size` engines on this device, made as they are needed: requests
    running at once (`prima serve --parallel`) each get an engine with its own KV cache, all
    sharing the model's weights, and take turns one forward pass at a time; with `batch`,
    the decode steps waiting at a turn run as one batch (continuous batching). A caller must
    not run more than `size` requests at once (the API's queue sees to it). `draft_model`
    drafts for requests that ask for one (`--draft-model`), each with its own cache.

    An engine keeps its cache after a request, so the pool is also a cache of up to `size`
    conversations: a request goes to the free engine whose held tokens share the longest
    prefix with its prompt (a chat's earlier turns, a common system prompt), which computes
    only the rest (prima.engine.prefix.reuse_prefix). A request that would cut into what an
    engine holds takes a new engine while the pool may grow; once it is full, the engine sharing
    the longest prefix, or the one used least recently (prima.engine.prefix.choose_held)."""

    def __init__(
        self,
        first: Engine,
        make_engine: Callable[[], Engine],
        size: int = 1,
        batch: bool = False,
        draft_model: DraftSource | None = None,
    ) -> None:
        if size < 1:
            raise InputError(f"the engine pool needs at least one engine, got {size}")
        self.n_ctx = first.n_ctx
        self.size = size
        self._make = make_engine
        self._free: list[Engine] = [first]  # least recently used first
        self._all: list[Engine] = [first]
        self._lock = threading.Lock()
        self._turns = TurnTaking()
        self.batcher = DecodeBatcher(self._turns) if batch else None
        self.draft_model = _DraftingInTurns(draft_model, self._turns) if draft_model else None

    def generate(self, request: GenerateRequest) -> Generator[TokenEvent, None, None]:
        engine = self._take(request.prompt_ids)
        try:
            yield from sample_tokens(
                _TakingTurns(engine, self._turns, self.batcher), request, draft_model=self.draft_model
            )
        finally:
            with self._lock:
                self._free.append(engine)

    @property
    def streamer(self) -> LayerWindows | None:
        """The layer buffer when the model streams from disk (then the pool holds one engine)."""
        first = self._all[0]
        return first.streamer if isinstance(first, LocalEngine) else None

    def _take(self, prompt: Sequence[int]) -> Engine:
        """The free engine whose cache `prompt` should continue (prima.engine.prefix.choose_held),
        or a new one while the pool may grow."""
        with self._lock:
            can_grow = len(self._all) < self.size
            if not self._free and not can_grow:
                raise RuntimeError(f"more than {self.size} generations at once on a pool of {self.size}")
            chosen = choose_held([_held(e) for e in self._free], prompt, can_grow)
            if chosen is not None:
                return self._free.pop(chosen)
            engine = self._make()
            self._all.append(engine)
            return engine

    def close(self) -> None:
        for engine in self._all:
            close = getattr(engine, "close", None)
            if close is not None:
                close()


def _held(engine: Engine) -> Sequence[int]:
    return engine.held_tokens if isinstance(engine, PrefixEngine) else ()


def local_generator(
    loaded: LoadedModel, n_ctx: int, parallel: int = 1, draft_model: DraftSource | None = None
) -> LocalGeneratorPool:
    """This device's generator for up to `parallel` requests at once, drafting with
    `draft_model` when asked to. A model that streams its layers from disk (bigger than
    memory) runs one request at a time: its layer buffer is one."""
    first = local_engine(loaded, n_ctx)
    if first.streamer is not None and parallel > 1:
        log.info("the layers stream from disk: requests run one at a time")
        parallel = 1
    batch = parallel > 1 and loaded.model.decode_batch_rows > 1
    return LocalGeneratorPool(
        first, lambda: LocalEngine(loaded.model, n_ctx=n_ctx), parallel, batch, draft_model
    )
