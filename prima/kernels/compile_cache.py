"""numba's on-disk cache of prima's kernels: where it lives, and whether it holds this machine's
build of the current sources.

`configure()` runs when prima.kernels is imported, before any kernel is defined: numba picks a
function's cache directory when the function is decorated. A cache that is complete for this CPU
is marked by a stamp file (prima.engine.warmup writes it after compiling everything once), so a
process can tell a first run, which compiles (COMPILE_TIME), from a later one, which loads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
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


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or paths.kernels_dir())


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def target_key() -> str:
    """What numba's cache index keys a build on beside the source: the CPU it compiles for."""
    import llvmlite.binding as llvm

    cpu = os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
    features = os.environ.get("NUMBA_CPU_FEATURES") or llvm.get_host_cpu_features().flatten()
    return hashlib.sha256(f"{cpu}|{features}".encode()).hexdigest()[:12]


def stamp_path() -> Path:
    return cache_dir() / f"complete-{paths.kernel_source_key()}-{target_key()}"


def is_complete() -> bool:
    """True once the kernels were compiled here for this CPU and these sources."""
    return stamp_path().exists()


def mark_complete() -> None:
    stamp_path().touch()


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
