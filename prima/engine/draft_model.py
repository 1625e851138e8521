"""A small draft model for speculative decoding: a second GGUF with the target's vocabulary, run
greedily where the generation runs (on this device, or on a ring's head) to guess the next few
tokens, which the target then checks in one pass.

Each generation drafts with its own KV cache over the draft model's shared weights. The cache
follows the context: drafts the target rejected are rewound before the next guess, and tokens
the draft model has not seen yet (the target's own samples, or a stretch where drafting paused)
are fed in one batch. Its numerics only change how many drafts are kept, never the output.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from prima.engine.local import LocalEngine
from prima.errors import InputError
from prima.forward.loader import LoadedModel, load_model
from prima.model.files import ModelFiles

log = logging.getLogger("prima.engine")


def shared_vocabulary(target: ModelFiles, draft: ModelFiles) -> int:
    """How many token ids mean the same token to both models (the ids a draft may propose).
    InputError naming both models when the vocabularies differ: a draft's ids would be read
    as other tokens by the target, so every draft would be wasted."""
    target_tokens = target.gguf.metadata.get("tokenizer.ggml.tokens", ())
    draft_tokens = draft.gguf.metadata.get("tokenizer.ggml.tokens", ())
    n_shared = min(len(target_tokens), len(draft_tokens))
    differs = next(
        (i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens, strict=False)) if a != b), None
    )
    if differs is not None or n_shared == 0:
        detail = (
            f"token {differs} is {target_tokens[differs]!r} in {target.name} and {draft_tokens[differs]!r} "
            f"in {draft.name}"
            if differs is not None
            else "one of them has no vocabulary"
        )
        raise InputError(
            f"the draft model {draft.name} ({draft.path}) does not share the vocabulary of {target.name} "
            f"({target.path}): {detail}; choose a draft model with the same tokenizer (a smaller model of "
            "the same family), or use --draft lookup"
        )
    # Ids past the shorter vocabulary, or past either model's embedding rows, are never proposed.
    return min(n_shared, target.config.vocab_size, draft.config.vocab_size)


class DraftModel:
    """A draft model loaded once (weights mmapped, kernels built) for a target model; each
    generation drafts through `drafter`, with its own KV cache."""

    def __init__(self, loaded: LoadedModel, n_shared: int) -> None:
        self.loaded = loaded
        self.n_shared = n_shared
        self.fingerprint = loaded.gguf.fingerprint()

    @property
    def name(self) -> str:
        return self.loaded.name

    def drafter(self, n_ctx: int) -> ModelDrafter:
        return ModelDrafter(LocalEngine(self.loaded.model, n_ctx), self.n_shared)


def load_draft_model(
    name_or_path: str | os.PathLike[str],
    target: ModelFiles,
    *,
    backend: str = "cpu",
    threads: int | None = None,
    mode: str = "q8",
    download: bool = True,
) -> DraftModel:
    """Load a draft model for `target`, its vocabulary checked against the target's first, and
    the kernels of its formats compiled before it runs (the target's may differ)."""
    from prima.engine.warmup import ensure_compiled
    from prima.model.registry import resolve_model

    ensure_compiled(resolve_model(name_or_path, download=download), on_stage=log.warning)
    loaded = load_model(name_or_path, backend=backend, threads=threads, mode=mode, download=download)
    n_shared = shared_vocabulary(target, loaded)
    log.info("drafting with %s (%d shared token ids) for %s", loaded.name, n_shared, target.name)
    return DraftModel(loaded, n_shared)


class ModelDrafter:
    """Greedy drafts from one engine over the draft model. `fed` is what its KV cache holds:
    a prefix of the context, then the drafts of the last pass but the last one."""

    def __init__(self, engine: LocalEngine, n_shared: int) -> None:
        self.engine = engine
        self.n_shared = n_shared
        self.fed: list[int] = []
        self._synced = 0  # fed[:_synced] is known to be the context (it only grows)

    def propose(self, context: Sequence[int], n_tokens: int) -> list[int]:
        """Up to `n_tokens` greedy guesses at what follows `context`; [] when none is asked for
        or they would not fit the draft model's context."""
        if n_tokens <= 0 or len(context) + n_tokens - 1 > self.engine.n_ctx:
            return []
        if not self.fed:
            # The prompt as the target ran it (one prefill); its last token then goes alone.
            self._feed(context[:-1], prefill=True)
        keep = self._common_prefix(context)
        # At least the last token is fed again: its logits give the first guess.
        keep = min(keep, len(context) - 1)
        self.engine.rewind(keep)
        del self.fed[keep:]
        logits = self._feed(context[keep:])
        self._synced = len(context)
        drafts: list[int] = []
        while True:
            token = int(np.argmax(logits[: self.n_shared]))
            drafts.append(token)
            if len(drafts) == n_tokens:
                return drafts
            logits = self._feed([token])

    def _feed(self, tokens: Sequence[int], prefill: bool = False) -> np.ndarray:
        """Append `tokens` to the cache; the last one's logits. Past the prompt, in batches
        whose rows equal tokens run alone, as the target checks drafts: a model drafting for
        itself then guesses exactly what the target samples greedily."""
        ids = [int(t) for t in tokens]
        step = max(len(ids), 1) if prefill else self.engine.model.backend.batch_identical_tokens
        logits = np.empty(0, dtype=np.float32)
        for s in range(0, len(ids), step):
            logits = self.engine.forward(ids[s : s + step])
        self.fed.extend(ids)
        return logits

    def _common_prefix(self, context: Sequence[int]) -> int:
        """How much of `fed` is still the context: all that was synced, then drafts as far as
        the target kept them."""
        n = self._synced
        limit = min(len(self.fed), len(context))
        while n < limit and self.fed[n] == context[n]:
            n += 1
        return n
