"""The real test models as GGUF indexes, found (or fetched) through the registry like every other
real-model test, so $PRIMA_CACHE and $XDG_CACHE_HOME are honoured (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.model.gguf_file import GGUFFile


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: Path) -> Iterator[GGUFFile]:
    with GGUFFile(smollm2_path) as gguf:
        yield gguf


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_path: Path) -> Iterator[GGUFFile]:
    with GGUFFile(gemma3_path) as gguf:
        yield gguf
