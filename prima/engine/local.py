"""A whole model on this device: the engine the ring's output is checked against."""

from __future__ import annotations

import numpy as np

from prima.errors import ContextFullError, InputError
from prima.model.transformer import Transformer

DEFAULT_UBATCH = 128  # prefill dequantizes each weight tile once per micro-batch


class LocalEngine:
    """Runs every layer here. `forward` appends tokens to the session's KV cache and returns the
    logits of the last one; prefill goes in micro-batches of `ubatch` tokens."""

    def __init__(self, model: Transformer, n_ctx: int, ubatch: int = DEFAULT_UBATCH) -> None:
        if n_ctx <= 0:
            raise InputError(f"context size must be positive, got {n_ctx}")
        self.model = model
        self.n_ctx = min(n_ctx, model.config.context_length)
        self.ubatch = ubatch
        self.cache = model.new_cache(self.n_ctx)
        self.n_past = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def reset(self) -> None:
        self.cache.truncate(0)
        self.n_past = 0

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size == 0:
            raise InputError("nothing to compute: the token list is empty")
        if self.n_past + ids.size > self.n_ctx:
            raise ContextFullError(
                f"{self.n_past + ids.size} tokens do not fit the context of {self.n_ctx}; "
                "shorten the prompt, lower -n, or raise --ctx"
            )
        m = self.model
        last = None
        for s in range(0, ids.size, self.ubatch):
            chunk = ids[s : s + self.ubatch]
            positions = np.arange(self.n_past, self.n_past + chunk.size)
            h = m.embed(chunk)
            h = m.forward_layers(h, positions, 0, m.config.n_layers, self.cache)
            last = h[-1:]
            self.n_past += chunk.size
        return m.output_logits(last)[0]
