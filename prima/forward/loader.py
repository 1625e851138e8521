"""Open a model for compute: its files (prima.model.files) and a WindowedModel on a backend."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from prima import heap
from prima.backends import get_backend
from prima.forward.windowed_model import WindowedModel
from prima.kernels import jit_memory
from prima.model.files import ModelFiles, open_model

log = logging.getLogger("prima.forward")


@dataclass
class LoadedModel(ModelFiles):
    model: WindowedModel


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    backend: str = "cpu",
    threads: int | None = None,
    mode: str = "q8",
    layers: range | None = None,
    download: bool = True,
    npu_ctx: int | None = None,
) -> LoadedModel:
    """Resolve, open and validate a model, and build its forward pass on `backend`. `layers`
    limits validation to the layers this node will run. `mode` is the backend's arithmetic:
    "q8" (int8 decode activations, fast) or "exact"; `npu_ctx` the KV slots of an NPU backend's
    compiled windows."""
    heap.one_arena()  # before compute threads start: see prima.heap (peak RSS)
    files = open_model(name_or_path, layers=layers, download=download)
    model = WindowedModel(
        files.weights, get_backend(backend, files.weights, threads=threads, mode=mode, npu_ctx=npu_ctx)
    )
    # Before any weight page is read: see prima.kernels.jit_memory (peak RSS).
    jit_memory.preload_and_release()
    cfg = files.config
    log.info(
        "loaded %s: %s, %d layers, d=%d, vocab %d",
        files.path.name,
        cfg.arch,
        cfg.n_layers,
        cfg.d_model,
        cfg.vocab_size,
    )
    return LoadedModel(files.path, files.gguf, files.weights, model)
