"""prima's cache root: PRIMA_CACHE, else XDG_CACHE_HOME (what the systemd unit and the container
set), else ~/.cache; models, profiles and kernels all under it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from prima import paths


def test_prima_cache_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIMA_CACHE", str(tmp_path / "p"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert paths.cache_root() == tmp_path / "p"
    assert paths.models_dir() == tmp_path / "p" / "models"
    assert paths.profiles_dir() == tmp_path / "p" / "profiles"
    assert paths.kernels_dir().parent == tmp_path / "p" / "kernels"


def test_xdg_cache_home_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRIMA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache")
    assert paths.models_dir() == Path("/var/cache/prima/models")


def test_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRIMA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert paths.cache_root() == Path.home() / ".cache" / "prima"


def test_kernel_directory_changes_with_the_kernel_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "kernels"
    sources.mkdir()
    (sources / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(paths, "KERNEL_SOURCES", sources)
    before = paths.kernel_source_key()
    assert paths.kernel_source_key() == before
    (sources / "a.py").write_text("x = 2\n")
    assert paths.kernel_source_key() != before


def test_kernel_directory_changes_with_the_installed_numba(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numba's version is read from its version module without importing numba (whose cache
    directory is this key) or importlib.metadata."""
    numba_dir = tmp_path / "numba"
    numba_dir.mkdir()
    (numba_dir / "__init__.py").write_text("")
    (numba_dir / "_version.py").write_text('version_json = \'{"version": "0.68.1"}\'\n')
    spec = importlib.util.spec_from_file_location("numba", numba_dir / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "numba" else None)
    before = paths.kernel_source_key()
    (numba_dir / "_version.py").write_text('version_json = \'{"version": "0.69.0"}\'\n')
    assert paths.kernel_source_key() != before
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no numba installed
    assert paths.kernel_source_key() not in (before, "")
