"""Kernels preloaded from numba's cache before the weights are read, and LLVM's pages released:
the forward pass then compiles nothing and gives the same logits."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.kernels import jit_memory
from tests.conftest import run_python

numba = pytest.importorskip("numba")

REPO = Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")

# A package of kernels: `inner` is called only from kernels; `outer` and `shared` from Python;
# `user` from nowhere yet (so it counts as called from Python).
LEAF = """
from numba import njit


@njit(cache=True)
def inner(x):
    return x + 1


@njit(cache=True)
def outer(x):
    return inner(x) * 2


def call(x):
    return outer(x)
"""
TABLE = """
from numba import njit

from {pkg} import leaf


@njit(cache=True)
def shared(x):
    return leaf.inner(x) - 1


@njit(cache=True)
def user(x):
    return shared(x) + 1


@njit(cache=True)
def via_outer(x):
    return leaf.outer(x) + 100


def python_side(x):
    return shared(x)
"""


@pytest.fixture
def kernel_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"jm_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "leaf.py").write_text(LEAF)
    (pkg / "table.py").write_text(TABLE.format(pkg=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    _forget(name)


def _forget(package: str) -> None:
    for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[mod]
    importlib.invalidate_caches()


def _names(dispatchers: list) -> set[str]:
    return {d.__name__ for d in dispatchers}


def test_entry_dispatchers_leave_out_kernels_only_kernels_call(kernel_package: str) -> None:
    assert _names(jit_memory.kernel_dispatchers(kernel_package)) == {
        "inner",
        "outer",
        "shared",
        "user",
        "via_outer",
    }
    assert _names(jit_memory.entry_dispatchers(kernel_package)) == {"outer", "shared", "user", "via_outer"}


def test_preload_loads_cached_overloads_without_compiling(kernel_package: str) -> None:
    importlib.import_module(f"{kernel_package}.leaf").call(3)  # compiles outer (and inner), caches both
    _forget(kernel_package)
    leaf = importlib.import_module(f"{kernel_package}.leaf")
    assert not leaf.outer.overloads

    assert jit_memory.preload_cached(jit_memory.entry_dispatchers(kernel_package)) == 1
    assert len(leaf.outer.overloads) == 1
    assert not leaf.inner.overloads  # outer's cached code contains it
    assert sum(leaf.outer.stats.cache_hits.values()) == 1
    assert not leaf.outer.stats.cache_misses
    assert leaf.call(3) == 8
    assert len(leaf.outer.overloads) == 1


def _preloaded_table(kernel_package: str, caplog: pytest.LogCaptureFixture) -> Any:
    """The package's `table` module in a fresh import, its one cached kernel preloaded (compiled
    and cached first), with prima.kernels' debug log captured."""
    caplog.set_level(logging.DEBUG, logger="prima.kernels")
    importlib.import_module(f"{kernel_package}.leaf").call(3)
    _forget(kernel_package)
    table = importlib.import_module(f"{kernel_package}.table")
    assert jit_memory.preload_cached(jit_memory.entry_dispatchers(kernel_package)) == 1
    return table


def test_preloaded_kernel_links_into_a_new_compile(
    kernel_package: str, caplog: pytest.LogCaptureFixture
) -> None:
    table = _preloaded_table(kernel_package, caplog)
    library = next(iter(table.leaf.outer.overloads.values())).library
    assert library._shared_module is None  # dropped: no IR kept in memory, not even as bitcode
    cells = library._get_module_for_linking.__closure__
    assert not any(isinstance(c.cell_contents, bytes) for c in cells)
    # via_outer is compiled now and links outer's preloaded library: its IR is read again from
    # numba's cache entry.
    assert table.via_outer(3) == 108
    assert library._shared_module is not None
    assert not [r for r in caplog.records if "again to link" in r.getMessage()]


def test_preloaded_kernel_links_after_its_cache_entry_is_gone(
    kernel_package: str, caplog: pytest.LogCaptureFixture
) -> None:
    table = _preloaded_table(kernel_package, caplog)
    cache_dir = Path(table.leaf.outer._cache._cache_path)
    removed = [p for p in cache_dir.iterdir() if p.name.startswith("leaf.outer")]
    assert removed
    for p in removed:
        p.unlink()
    # Compiled again to link it: slower, but the new kernel compiles and is right.
    assert table.via_outer(3) == 108
    assert [r for r in caplog.records if "again to link" in r.getMessage()]
    assert table.leaf.call(3) == 8  # the preloaded code itself still runs


def test_preload_skips_entries_of_edited_source(kernel_package: str, tmp_path: Path) -> None:
    importlib.import_module(f"{kernel_package}.leaf").call(3)
    _forget(kernel_package)
    with (tmp_path / kernel_package / "leaf.py").open("a") as f:
        f.write("\n# edited: numba's index no longer matches\n")
    importlib.import_module(f"{kernel_package}.leaf")
    assert jit_memory.preload_cached(jit_memory.entry_dispatchers(kernel_package)) == 0


def _llvmlite(mappings: list[jit_memory.MemoryMap]) -> list[jit_memory.MemoryMap]:
    return [m for m in mappings if Path(m.path).name.startswith("libllvmlite")]


@pytest.mark.skipif(not LINUX, reason="needs /proc and madvise")
def test_release_drops_clean_compiler_pages_and_keeps_the_rest() -> None:
    @numba.njit
    def double(x: int) -> int:
        return 2 * x

    assert double(2) == 4  # LLVM has run in this process
    before = _llvmlite(jit_memory.mappings())
    if not before:
        pytest.skip("numba's LLVM is not a separate shared object here")
    droppable = {(m.start, m.end) for m in jit_memory.compiler_mappings()}
    kept = {(m.start, m.end): m.rss for m in before if (m.start, m.end) not in droppable}
    assert droppable
    assert any("w" in m.perms for m in before if (m.start, m.end) not in droppable)  # .data/.bss

    assert jit_memory.release_compiler_pages() > 0
    after = {(m.start, m.end): m for m in _llvmlite(jit_memory.mappings())}
    assert sum(after[r].rss for r in droppable) < 256 * 1024
    assert all(after[r].rss == rss for r, rss in kept.items() if "w" in after[r].perms)

    @numba.njit
    def triple(x: int) -> int:
        return 3 * x

    assert triple(2) == 6  # the compiler runs again: its pages fault back in from the file


# Runs in a fresh process: load SmolLM2, then prefill and decode; prints what it saw as JSON.
FORWARD = """
import json, sys
import numpy as np
from pathlib import Path
from prima.engine.local import LocalEngine
from prima.kernels import jit_memory
from prima.forward import loader

if sys.argv[1] == "lazy":
    loader.jit_memory.preload_and_release = lambda: None
loaded = loader.load_model("smollm2-135m", threads=2, mode="q8")
compiler_rss = sum(m.rss for m in jit_memory.compiler_mappings())
before = {id(d): len(d.overloads) for d in jit_memory.kernel_dispatchers()}
engine = LocalEngine(loaded.model, n_ctx=64)
logits = [engine.forward(list(range(100, 120)))]  # prefill
for _ in range(3):  # decode
    logits.append(engine.forward([int(np.argmax(logits[-1]))]))
new = sorted(d.__name__ for d in jit_memory.kernel_dispatchers() if len(d.overloads) != before.get(id(d), 0))
np.save(sys.argv[2], np.stack(logits))
scipy_linalg = "scipy.linalg" in sys.modules
lowering = "numba.np.linalg" in sys.modules  # one of the modules only numba's compiler uses
print(json.dumps({"compiler_rss": compiler_rss, "new": new, "scipy_linalg": scipy_linalg, "lowering": lowering}))
"""


def _forward(mode: str, out: Path) -> dict:
    done = run_python(textwrap.dedent(FORWARD), mode, str(out), timeout=900, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="needs /proc and madvise")
def test_load_model_preloads_every_kernel_the_forward_pass_uses(smollm2_path: Path, tmp_path: Path) -> None:
    del smollm2_path  # fetched by the fixture; the subprocesses open it by name
    lazy = _forward("lazy", tmp_path / "lazy.npy")  # kernels loaded (or compiled) on first call
    preloaded = _forward("preload", tmp_path / "preload.npy")
    assert lazy["compiler_rss"] > 0  # nothing released: the comparison below means something
    assert preloaded["compiler_rss"] < 1 << 20
    assert preloaded["new"] == []
    # numba's own cache load imports its lowering modules (and scipy's BLAS); preloading needs
    # neither, and the forward pass then runs without them.
    assert lazy["lowering"]
    assert not preloaded["lowering"]
    assert not preloaded["scipy_linalg"]
    np.testing.assert_array_equal(np.load(tmp_path / "preload.npy"), np.load(tmp_path / "lazy.npy"))


def test_no_kernel_lets_llvm_change_its_arithmetic() -> None:
    """numba links a copy of every callee into each caller, and the JIT binds a call by name to
    whichever copy was loaded first. With fastmath flags (contract, reassoc, ...) each copy is
    rounded as its own module's optimizer chose, so the bits would depend on load order."""
    flagged = sorted(d.__name__ for d in jit_memory.kernel_dispatchers() if d.targetoptions.get("fastmath"))
    assert flagged == []


# Runs in a fresh process: one exact Q4_K matmul; "leaf" first loads the dot kernel on its own,
# so that the matmul's call to it binds to that copy instead of the one inside the matmul's code.
LOAD_ORDER = """
import sys
import numpy as np
from gguf import GGMLQuantizationType as Q
from prima.kernels import matmul
from prima.kernels.formats import q4_k
from prima.kernels.quants import F16_TABLE
from tests.kernels.weights import random_qtensor

w = random_qtensor(Q.Q4_K, 32, 256, seed=1)
x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
if sys.argv[1] == "leaf":
    q4_k.dot(w.raw[0], x, F16_TABLE, np.zeros((1, 32), np.float32), 0)
np.save(sys.argv[2], matmul.matmul(w, x, False))
"""


@pytest.mark.slow
def test_kernel_bits_do_not_depend_on_how_the_kernels_were_loaded(tmp_path: Path) -> None:
    """Compiled in this process, loaded from numba's cache, or loaded after a callee's own copy:
    the same bits (a daemon that preloads and a coordinator that compiles must agree)."""
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    results = []
    for i, mode in enumerate(("cold", "warm", "leaf")):
        out = tmp_path / f"{i}.npy"
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(LOAD_ORDER), mode, str(out)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=900,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(np.load(out))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])
