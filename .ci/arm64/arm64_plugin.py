"""pytest plugin for the aarch64 run (.ci/arm64/run), where tests run under emulation:

- the tiny Qwen models and llama.cpp's outputs for them are read from $PRIMA_TINY_REFERENCES
  (written on the x86 host by tiny_references.py) instead of being made here, where
  llama-cpp-python is not installed; the tests and their tolerances are the x86 ones;
- tests that run the real test models (fixtures smollm2_path, gemma3_path and their GGUF
  indexes) are deselected: a 135M or 270M model takes minutes per test under qemu, and the
  tiny models take the same forward pass through the same kernels.
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REFERENCES_ENV = "PRIMA_TINY_REFERENCES"
REAL_MODEL_FIXTURES = {"smollm2_path", "gemma3_path", "smollm2_gguf", "gemma3_gguf", "private_copy"}


def pytest_configure(config: pytest.Config) -> None:
    directory = os.environ.get(REFERENCES_ENV)
    if not directory:
        return
    refs = Path(directory)

    def tiny_model_path(tag: str) -> Path:
        path = refs / f"{tag}-f32.gguf"
        if not path.exists():
            raise FileNotFoundError(f"no {path}: run .ci/arm64/tiny_references.py on the host first")
        return path

    @cache
    def load_tiny_oracle(tag: str) -> dict[str, Any]:
        outputs = json.loads((refs / f"{tag}.json").read_text(encoding="utf-8"))
        for prompt in outputs["prompts"]:
            for run in ("f32", "quant"):
                prompt[run]["logits"] = np.load(refs / prompt[run].pop("logits_file"))
        return outputs

    # tests/conftest.py is loaded by now (it is an initial conftest); the test modules that import
    # these two names from it are not, so they get the replacements.
    conftest = sys.modules["tests.conftest"]
    conftest.tiny_model_path = tiny_model_path
    conftest.load_tiny_oracle = load_tiny_oracle


def _uses_a_real_model(item: pytest.Item) -> bool:
    """By a fixture, or by a parameter naming one (tests that call request.getfixturevalue)."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {v for v in callspec.params.values() if isinstance(v, str)}
    return bool(names & REAL_MODEL_FIXTURES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    real = [item for item in items if _uses_a_real_model(item)]
    if real:
        items[:] = [item for item in items if item not in real]
        config.hook.pytest_deselected(items=real)
        print(f"\naarch64: {len(real)} tests of the real test models deselected (too slow under emulation)")  # noqa: T201
