"""load_model: what it checks at once and what it leaves until used."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.errors import TokenizerError
from prima.forward.loader import load_model
from tests.tiny_models import write_tiny_model


def test_tokenizer_is_built_on_first_use(tmp_path: Path) -> None:
    """A daemon loads the model without the vocabulary; only asking for the tokenizer fails."""
    loaded = load_model(write_tiny_model(tmp_path / "odd.gguf", pre="no-such-pre"), layers=range(0))
    assert "tokenizer" not in vars(loaded)
    with pytest.raises(TokenizerError, match="no-such-pre"):
        _ = loaded.tokenizer


def test_tokenizer_is_built_once(tmp_path: Path) -> None:
    loaded = load_model(write_tiny_model(tmp_path / "tiny.gguf"), layers=range(0))
    assert loaded.tokenizer is loaded.tokenizer
