"""Open a model by name or path: GGUF index, weights, tokenizer and a Transformer on a backend."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from prima.backends import get_backend
from prima.kernels import jit_memory
from prima.model.gguf_file import GGUFFile
from prima.model.registry import resolve_model
from prima.model.tokenizer import Tokenizer
from prima.model.transformer import Transformer
from prima.model.weights import ModelWeights

log = logging.getLogger("prima.model")


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile
    weights: ModelWeights
    model: Transformer

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Built on first use: a daemon that only computes layers never needs the vocabulary, so
        a vocabulary prima cannot tokenize does not stop it serving."""
        return Tokenizer.from_gguf(self.gguf.metadata)

    @property
    def name(self) -> str:
        return str(self.gguf.metadata.get("general.name", self.path.stem))


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    backend: str = "cpu",
    threads: int | None = None,
    mode: str = "q8",
    layers: range | None = None,
    download: bool = True,
) -> LoadedModel:
    """Resolve, open and validate a model. `layers` limits validation to the layers this node
    will run, so a node never touches pages of layers it does not own. `mode` is the backend's
    arithmetic: "q8" (int8 decode activations, fast) or "exact"."""
    path = resolve_model(name_or_path, download=download)
    gguf = GGUFFile(path)
    weights = ModelWeights(gguf)
    weights.validate(layers)
    model = Transformer(weights, get_backend(backend, threads=threads, mode=mode))
    # Before any weight page is read: see prima.kernels.jit_memory (peak RSS).
    jit_memory.preload_and_release()
    cfg = weights.config
    log.info(
        "loaded %s: %s, %d layers, d=%d, vocab %d",
        path.name,
        cfg.arch,
        cfg.n_layers,
        cfg.d_model,
        cfg.vocab_size,
    )
    return LoadedModel(path, gguf, weights, model)
