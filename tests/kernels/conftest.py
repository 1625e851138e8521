"""The real test models, opened when they are on disk and skipped (with the reason) when not."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.model.gguf_file import GGUFFile

MODELS = Path.home() / ".cache" / "prima" / "models"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = MODELS / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> GGUFFile:
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} not present; fetch SmolLM2-135M-Instruct Q4_1 to run real-model tests")
    return GGUFFile(SMOLLM2)


@pytest.fixture(scope="session")
def gemma3_gguf() -> GGUFFile:
    if not GEMMA3.exists():
        pytest.skip(f"{GEMMA3} not present; fetch gemma-3-270m Q4_K_M to run real-model tests")
    return GGUFFile(GEMMA3)
