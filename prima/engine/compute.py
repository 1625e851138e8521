"""The start of every process that computes layers, in one order: compile the kernels (once per
CPU and source), tune the threads, then load the model (and a draft model). `prima` on one
device and each `primad` start the same way, so neither waits on a compile while serving.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prima.engine.thread_tuning import tuned_setting
from prima.engine.warmup import OnProgress, ensure_compiled

# The model code (numba) loads when a model is opened, not when this module is imported: a
# command's flags are read, and refused, first.
if TYPE_CHECKING:
    from prima.engine.draft_model import DraftModel
    from prima.forward.loader import LoadedModel

# Makes the progress callback of one slow step, labelled (a terminal's bar, or nothing).
StepBars = Callable[[str], AbstractContextManager[OnProgress | None]]


def no_bars(_what: str) -> AbstractContextManager[OnProgress | None]:
    """No progress bar: for callers with nobody watching."""
    return nullcontext(None)


@dataclass(frozen=True)
class Compute:
    """A model ready to compute, with the threads it computes on and its draft model if any."""

    loaded: LoadedModel
    threads: int | None
    draft_model: DraftModel | None = None


def open_compute(
    path: str | os.PathLike[str],
    *,
    backend: str = "cpu",
    threads: int | None = None,
    mode: str = "q8",
    layers: range | None = None,
    npu_ctx: int | None = None,
    tune: bool = True,
    draft_model: str | os.PathLike[str] | None = None,
    draft_backend: str = "cpu",
    on_stage: Callable[[str], None] | None = None,
    steps: StepBars = no_bars,
) -> Compute:
    """Compile, tune (on the cpu backend, when `tune`: a node still fetching its file cannot
    measure it) and load `path`; `layers` limits what is validated now (range(0): none, for a
    daemon that validates its windows when a plan names them)."""
    from prima.engine.draft_model import load_draft_model
    from prima.forward.loader import load_model

    with steps("compiling") as bar:
        ensure_compiled(path, on_stage=on_stage, on_progress=bar)
    if backend == "cpu" and tune:
        setting = tuned_setting(path, on_stage=on_stage, threads=threads)
        threads = setting.threads if setting else threads
    loaded = load_model(path, backend=backend, threads=threads, mode=mode, layers=layers, npu_ctx=npu_ctx)
    draft = None
    if draft_model is not None:
        draft = load_draft_model(draft_model, loaded, backend=draft_backend, threads=threads, mode=mode)
    return Compute(loaded, threads, draft)
