"""numba's on-disk cache of prima's kernels: where it lives, and whether it holds this machine's
build of the current sources.

`configure()` runs when prima.kernels is imported, before any kernel is defined: numba picks a
function's cache directory when the function is decorated. A cache that holds this CPU's build
is marked by a stamp file listing the weight formats compiled so far (prima.engine.warmup writes
it after each compile), so a process can tell a first run, which compiles (COMPILE_TIME), from a
later one, which loads, and a model of a new format gets its kernels before it runs, not while.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prima import paths

log = logging.getLogger("prima.kernels")

CACHE_DIR_ENV = "NUMBA_CACHE_DIR"
# How long the first compile takes, as every message and doc says it: 83, 103 and 226 s were
# measured on x86 servers of 2 vCPUs; a small ARM board is at the slow end.
COMPILE_TIME = "1-4 minutes by CPU"


def configure() -> Path:
    """Point numba at paths.kernels_dir() unless NUMBA_CACHE_DIR is set already; returns the
    directory in use. One that cannot be written is replaced by a temporary directory: the
    kernels then compile on every start, where numba itself would refuse to import them."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if not chosen:
        target = paths.kernels_dir()
        if not _writable(target):
            fallback = tempfile.mkdtemp(prefix="prima-kernels-")
            log.warning(
                "cannot write the kernel cache %s; compiling into %s for this run only (set PRIMA_CACHE "
                "or XDG_CACHE_HOME to a writable directory to compile once)",
                target,
                fallback,
            )
            target = Path(fallback)
        chosen = str(target)
        # Also in the environment: numba re-reads it on a config reload, and children inherit it.
        os.environ[CACHE_DIR_ENV] = chosen
    # numba reads the variable when it loads; importing it here would load it before
    # prima.kernels.thread_env has set up the thread pools, so only a loaded numba is updated.
    config = sys.modules.get("numba.core.config")
    if config is not None:
        config.CACHE_DIR = chosen
    return Path(chosen)


def have_numba() -> bool:
    """Whether numba and llvmlite are installed, found without importing them (see configure);
    without them prima runs the numpy fallback, which compiles nothing."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("numba", "llvmlite"))
    except (ImportError, ValueError):  # a blocked or half-imported package
        return False


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or paths.kernels_dir())


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def target_key() -> str:
    """What numba's cache index keys a build on beside the source: the CPU it compiles for.
    Without llvmlite (a device with no numba, the numpy fallback) nothing is compiled, and the
    key only names the architecture for what else is kept per CPU (the thread tuning)."""
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return hashlib.sha256(f"no-llvmlite|{platform.machine()}".encode()).hexdigest()[:12]
    cpu = os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
    features = os.environ.get("NUMBA_CPU_FEATURES") or llvm.get_host_cpu_features().flatten()
    return hashlib.sha256(f"{cpu}|{features}".encode()).hexdigest()[:12]


def stamp_path() -> Path:
    return cache_dir() / f"complete-{paths.kernel_source_key()}-{target_key()}"


def compiled_formats() -> frozenset[str] | None:
    """The weight formats (ggml type names) whose kernels the cache holds for this CPU and these
    sources; None before the first compile."""
    try:
        text = stamp_path().read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return frozenset(text.split())


def is_complete(formats: Iterable[str] = ()) -> bool:
    """True once the kernels were compiled here for this CPU and these sources, those of every
    format in `formats` among them."""
    done = compiled_formats()
    return done is not None and done.issuperset(formats)


def mark_complete(formats: Iterable[str] = ()) -> None:
    """Record a compile that covered `formats` (beside the formats recorded before)."""
    stamp = stamp_path()
    lines = sorted((compiled_formats() or frozenset()).union(formats))
    # Replaced whole: a process checking the stamp meanwhile never reads half a list.
    partial = stamp.with_name(f".{stamp.name}.{os.getpid()}")
    partial.write_text("".join(f"{fmt}\n" for fmt in lines), encoding="utf-8")
    os.replace(partial, stamp)


@contextmanager
def exclusive() -> Iterator[None]:
    """Held while compiling: daemons started together wait for one compile instead of racing
    (each would otherwise compile everything, on the same cores)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; concurrent first starts just compile twice
        yield
        return
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "compile.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
