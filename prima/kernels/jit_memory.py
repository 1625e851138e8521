"""Keep numba's compiler out of resident memory once the kernels are loaded.

LLVM's code (libllvmlite.so, ~70 MiB resident once numba has loaded a kernel) runs only while
numba compiles a kernel or loads one from its disk cache; inference never executes it.
`preload_and_release` loads, up front, every cached overload of the kernels Python calls, then
hands LLVM's clean read-only pages back to the OS (they refault from the file if numba ever
compiles again: correct, only slower). It must run before the weights are first read: peak RSS
is the maximum over the process's life, so pages dropped once the weights are resident lower
nothing.

Preloading relies on numba's private cache layout and releasing on Linux's /proc; anything
unexpected makes them do nothing rather than fail.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.util
import inspect
import logging
import pkgutil
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import CodeType, FunctionType, ModuleType
from typing import Any

from prima import heap

log = logging.getLogger("prima.kernels")

KERNEL_PACKAGE = "prima.kernels"
# Shared objects whose code only the compiler runs.
COMPILER_LIBRARIES: tuple[str, ...] = ("libllvmlite",)
_MADV_DONTNEED = 4


@dataclass(frozen=True)
class Settled:
    """What preload_and_release did: overloads loaded from numba's cache, compiler bytes dropped."""

    overloads_loaded: int
    compiler_bytes_released: int


def preload_and_release(package: str = KERNEL_PACKAGE) -> Settled:
    """Load the cached overloads of `package`'s entry kernels, then release the compiler's pages."""
    loaded = preload_cached(entry_dispatchers(package))
    released = release_compiler_pages()
    log.debug("preloaded %d kernel overloads, released %.1f MiB of compiler code", loaded, released / 2**20)
    return Settled(loaded, released)


# -- which kernels ------------------------------------------------------------------------------
def kernel_dispatchers(package: str = KERNEL_PACKAGE) -> list[Any]:
    """Every numba dispatcher bound to a global of a module of `package`, once each. All of the
    package's modules are imported first: kernels are discovered, not listed, so a new kernel
    module is covered without edits here."""
    try:
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return []
    _import_submodules(package)
    found: dict[int, Any] = {}
    for module in _modules(package):
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher):
                found.setdefault(id(value), value)
    return list(found.values())


def entry_dispatchers(package: str = KERNEL_PACKAGE) -> list[Any]:
    """The dispatchers of `package` that Python calls: those a non-jitted function of a loaded
    module of the top-level package names, and those no jitted function names. A kernel only
    other kernels call is left out: its callers' cached code already contains it, and loading
    its own overloads would only cost memory (1-8 MiB each)."""
    dispatchers = kernel_dispatchers(package)
    if not dispatchers:  # no numba (or no kernels): nothing to preload
        return []
    kernel_modules = {id(m) for m in _modules(package)}
    jitted = {d.py_func.__code__ for d in dispatchers}
    from_jit: set[int] = set()
    for d in dispatchers:
        fn = d.py_func
        from_jit |= _named_dispatchers(fn.__code__, fn.__globals__, kernel_modules, jitted - {fn.__code__})
        from_jit |= {id(cell.cell_contents) for cell in fn.__closure__ or ()}
    from_python: set[int] = set()
    for fn in _python_functions(package.partition(".")[0]):
        if fn.__code__ in jitted:  # a dispatcher's own py_func, reached through __wrapped__
            continue
        from_python |= _named_dispatchers(fn.__code__, fn.__globals__, kernel_modules, jitted)
    return [d for d in dispatchers if id(d) in from_python or id(d) not in from_jit]


def _import_submodules(package: str) -> None:
    """Import the modules of `package` that import numba (a module imported lazily, on a first
    call, holds kernels too); others are left alone, since importing one may have effects."""
    try:
        pkg = importlib.import_module(package)
    except ImportError:
        return
    for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
        name = f"{package}.{info.name}"
        if name in sys.modules or not _imports_numba(name):
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional dependency is missing: those kernels never run
            log.debug("not preloading %s: %s", name, exc)


def _imports_numba(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else ""
    except (ImportError, OSError, ValueError):
        return False
    return re.search(r"^\s*(from|import)\s+numba\b", source, re.MULTILINE) is not None


def _modules(package: str) -> list[ModuleType]:
    return [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, ModuleType) and (name == package or name.startswith(package + "."))
    ]


def _python_functions(package: str) -> Iterator[FunctionType]:
    """Plain functions, methods and properties defined in the loaded modules of `package`."""
    for module in _modules(package):
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            members = list(vars(value).values()) if isinstance(value, type) else [value]
            for member in members:
                for obj in (member, getattr(member, "__func__", None), getattr(member, "fget", None)):
                    fn = inspect.unwrap(obj) if callable(obj) else obj
                    if isinstance(fn, FunctionType):
                        yield fn


def _named_dispatchers(
    code: CodeType, env: dict[str, Any], kernel_modules: set[int], skip: set[CodeType]
) -> set[int]:
    """ids of the dispatchers that `code`, or code nested in it other than `skip`, names through
    its globals `env`, as `name` or as `module.name` for a kernel module."""
    from numba.core.dispatcher import Dispatcher

    found: set[int] = set()
    stack = [code]
    while stack:
        co = stack.pop()
        names = set(co.co_names)
        for name in names:
            value = env.get(name)
            if isinstance(value, Dispatcher):
                found.add(id(value))
            elif isinstance(value, ModuleType) and id(value) in kernel_modules:
                found |= {id(v) for v in (vars(value).get(a) for a in names) if isinstance(v, Dispatcher)}
        stack.extend(c for c in co.co_consts if isinstance(c, CodeType) and c not in skip)
    return found


# -- loading from numba's cache -----------------------------------------------------------------
def preload_cached(dispatchers: Iterable[Any]) -> int:
    """Load from numba's disk cache each overload of `dispatchers` that was compiled for this
    machine and the current source; returns how many were loaded. Never compiles: entries for
    another CPU or for older code are skipped, and so is a dispatcher whose cache this does not
    understand (numba's private API)."""
    pending = [(disp, sig) for disp in dispatchers for sig in _safe_signatures(disp)]
    if not pending:
        return 0
    loaded = 0
    with _lowering_left_unloaded(pending[0][0].targetctx):
        for disp, sig in pending:
            try:
                disp.compile(sig)
                _drop_linking_module(disp, sig)
                loaded += 1
            except Exception as exc:  # best effort: the first call loads it instead
                log.debug("could not preload %s%s from numba's cache: %s", disp.__name__, sig, exc)
    return loaded


@contextmanager
def _lowering_left_unloaded(targetctx: Any) -> Iterator[None]:
    """numba's cache load first refreshes the target context: it imports every lowering module
    (~100 modules, ~11 MiB resident) that only compiling uses. Loading machine code from the
    cache needs just the runtime (NRT) whose functions that code calls, so while preloading,
    refresh initializes that alone. A later compile still refreshes (numba's compiler does so
    itself), and so does a cache load on a kernel's first call."""
    try:
        from numba.core.runtime import nrt

        nrt.rtsys.initialize(targetctx)
    except Exception as exc:  # numba private API: refresh fully, as numba would
        log.debug("numba's runtime did not initialize on its own: %s", exc)
        yield
        return
    targetctx.refresh = _no_refresh
    try:
        yield
    finally:
        del targetctx.refresh


def _no_refresh() -> None:
    """The target context's refresh while preloading (see _lowering_left_unloaded)."""


def _cached_signatures(disp: Any) -> Iterator[tuple]:
    """Signatures in `disp`'s cache index whose key (signature, CPU, bytecode hash) is the one
    numba itself looks up here, so that compile() of them is a cache load."""
    from numba.core.caching import Cache

    cache = getattr(disp, "_cache", None)
    if not isinstance(cache, Cache):
        return
    codegen = disp.targetctx.codegen()
    for key in cache._cache_file._load_index():
        sig = key[0]
        if key == cache._index_key(sig, codegen):
            yield sig


def _safe_signatures(disp: Any) -> list[tuple]:
    try:
        return [sig for sig in _cached_signatures(disp) if tuple(sig) not in disp.overloads]
    except Exception:  # numba private API
        return []


def _drop_linking_module(disp: Any, sig: tuple) -> None:
    """Drop the LLVM IR that a cache-loaded overload of `disp` keeps only for linking into a
    future compile (~1.5 MiB over prima's kernels, 0.6 MiB for a fused layer): the loaded
    machine code runs without it. If numba ever links the overload into a new compile, the IR
    is read again from the cache entry it was loaded from, or, should that entry be gone or
    stale, compiled afresh (slow, but the compile succeeds)."""
    library = disp.overloads[tuple(sig)].library
    relink = getattr(type(library), "_get_module_for_linking", None)
    if getattr(library, "_shared_module", None) is None or relink is None:
        return
    if "_get_module_for_linking" in vars(library):
        return

    def module_for_linking() -> Any:
        if library._shared_module is None:
            library._shared_module = _linking_module(disp, sig, library.name)
        return relink(library)

    library._get_module_for_linking = module_for_linking
    library._shared_module = None


def _linking_module(disp: Any, sig: tuple, name: str) -> Any:
    """The linking module of `disp`'s overload `sig` (library `name`): from numba's cache entry,
    which stores it beside the object code, else compiled again."""
    import llvmlite.binding as llvm

    try:
        cache = disp._cache
        payload = cache._cache_file.load(cache._index_key(sig, disp.targetctx.codegen()))
        lib_name, kind, (_, bitcode) = payload[0]
        if lib_name == name and kind == "object":
            return llvm.parse_bitcode(bitcode)
    except Exception as exc:  # numba private API or a vanished file: compile instead
        log.debug("no cached linking module for %s%s: %s", disp.__name__, sig, exc)
    log.debug("compiling %s%s again to link it", disp.__name__, sig)
    return disp._compiler._compile_core(tuple(sig), None).library._get_module_for_linking()


# -- releasing the compiler's pages -------------------------------------------------------------
@dataclass(frozen=True)
class MemoryMap:
    """One mapping of /proc/<pid>/smaps: address range, permissions, file, and its resident and
    private-dirty (copy-on-write or anonymous) sizes in bytes."""

    start: int
    end: int
    perms: str
    path: str
    rss: int
    anonymous: int


def mappings(pid: str = "self") -> list[MemoryMap]:
    """The process's mappings ([] where there is no /proc)."""
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return []
    out: list[MemoryMap] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if not fields[0].endswith(":"):  # "start-end perms offset dev inode [path]" opens a mapping
            start, end = (int(a, 16) for a in fields[0].split("-"))
            out.append(MemoryMap(start, end, fields[1], fields[5] if len(fields) > 5 else "", 0, 0))
        elif out and fields[0] in ("Rss:", "Anonymous:"):
            size = int(fields[1]) * 1024
            field = "rss" if fields[0] == "Rss:" else "anonymous"
            out[-1] = replace(out[-1], **{field: size})
    return out


def compiler_mappings() -> list[MemoryMap]:
    """Mappings of COMPILER_LIBRARIES safe to drop: not writable and without private pages, so
    every resident page equals the file's and refaults unchanged. RELRO (read-only after the
    loader relocated it, so private) and .data/.bss never qualify: dropping those corrupts LLVM."""
    return [
        m
        for m in mappings()
        if Path(m.path).name.startswith(COMPILER_LIBRARIES) and "w" not in m.perms and m.anonymous == 0
    ]


def release_compiler_pages() -> int:
    """Drop the resident pages of compiler_mappings() and return free heap pages to the OS;
    returns the compiler bytes released (0 where madvise or /proc is unavailable)."""
    libc = _libc()
    if libc is None:
        return 0
    released = 0
    for m in compiler_mappings():
        if m.rss and libc.madvise(m.start, m.end - m.start, _MADV_DONTNEED) == 0:
            released += m.rss
    heap.trim()
    return released


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc
