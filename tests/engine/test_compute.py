"""open_compute, the one start of every process that computes layers: the kernels compiled
first (behind the caller's progress bar), the model then loaded as the caller asked, and a
draft model loaded beside it on the same threads."""

from __future__ import annotations

import numpy as np

from prima.engine.compute import open_compute
from prima.engine.local import LocalEngine
from prima.forward.loader import load_model
from tests.conftest import tiny_model_path


def test_open_compute_loads_what_load_model_loads() -> None:
    """No tuning, one thread: the same logits as load_model on its own gives."""
    path = tiny_model_path("tiny-qwen2")
    compute = open_compute(path, threads=1, mode="exact", tune=False)
    assert compute.threads == 1
    assert compute.draft_model is None
    ids = [5, 6, 7]
    got = LocalEngine(compute.loaded.model, n_ctx=16).forward(ids)
    want = LocalEngine(load_model(path, threads=1, mode="exact").model, n_ctx=16).forward(ids)
    np.testing.assert_array_equal(got, want)


def test_a_daemon_validates_no_layer_at_start() -> None:
    """layers=range(0): the file is mapped and checked, no layer validated (a plan names them)."""
    compute = open_compute(tiny_model_path("tiny-qwen2"), threads=1, layers=range(0), tune=False)
    assert compute.loaded.model.config.n_layers == 4


def test_the_draft_model_loads_beside_the_model() -> None:
    path = tiny_model_path("tiny-qwen2")
    compute = open_compute(path, threads=1, tune=False, draft_model=path)
    assert compute.draft_model is not None
    assert compute.draft_model.fingerprint == compute.loaded.gguf.fingerprint()


def test_compiling_reports_through_the_callers_bars() -> None:
    """The step bar is asked for once, for the compile, whether or not anything compiles."""
    asked: list[str] = []

    class Bars:
        def __init__(self, what: str) -> None:
            asked.append(what)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    open_compute(tiny_model_path("tiny-qwen2"), threads=1, tune=False, layers=range(0), steps=Bars)
    assert asked == ["compiling"]
