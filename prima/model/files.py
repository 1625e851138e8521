"""A model opened for what needs no compute: its GGUF index, weight views and tokenizer.

The coordinator only tokenizes and checks files, so it opens models this way: no backend, no
kernels compiled, no layer touched. prima.forward.loader builds compute on top of this."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from prima import heap
from prima.model.config import ModelConfig
from prima.model.gguf_file import GGUFFile
from prima.model.registry import resolve_model
from prima.model.tokenizer import Tokenizer
from prima.model.weights import ModelWeights


@dataclass
class ModelFiles:
    path: Path
    gguf: GGUFFile
    weights: ModelWeights

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Built on first use: a daemon that only computes layers never needs the vocabulary, so
        a vocabulary prima cannot tokenize does not stop it serving."""
        tokenizer = Tokenizer.from_gguf(self.gguf.metadata)
        heap.trim()  # indexing the vocabulary freed several MiB (gemma's: ~5) that stay resident
        self.gguf.release_header_pages()  # and read every page of its strings
        return tokenizer

    @property
    def name(self) -> str:
        return str(self.gguf.metadata.get("general.name", self.path.stem))

    @property
    def config(self) -> ModelConfig:
        return self.weights.config


def open_model(
    name_or_path: str | os.PathLike[str], *, layers: range | None = None, download: bool = True
) -> ModelFiles:
    """Resolve (fetching a registry model unless `download` is off), open and validate a model.
    `layers` limits validation to the layers a node will run, so it never touches pages of
    layers it does not own; `range(0)` checks none (a coordinator that only tokenizes)."""
    path = resolve_model(name_or_path, download=download)
    gguf = GGUFFile(path)
    weights = ModelWeights(gguf)
    weights.validate(layers)
    return ModelFiles(path, gguf, weights)
