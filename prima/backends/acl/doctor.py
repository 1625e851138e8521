"""`prima npu doctor`: what a new board's NPU toolchain does with a one-layer window, as lines a
user pastes into a bug report. It checks the toolchain (atc, pyACL, numpy, CANN's version),
compiles and loads layer 0 as the backend does, prints the model's inputs, outputs and gears as
the runtime reports them and the device's memory, and runs the window against the CPU backend.
Nothing here is known to pass on a device: it exists to find out (docs/orangepi.md)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from prima.backends.acl import atc
from prima.backends.acl.runtime import DDR_MEM, DYNAMIC_DIMS_INPUT, HBM_MEM, AclError, import_acl
from prima.errors import PrimaError
from prima.model.weights import ModelWeights

TOKENS = np.array([1, 2, 3])  # a prefill of three tokens (gears 2 and 1), then one decode step
NEEDED_FOR_A_WINDOW = ("atc", "pyACL")  # without them the window report cannot start


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, what was found, and whether it is fine."""

    check: str
    found: str
    ok: bool = True


def toolchain() -> Iterator[Finding]:
    """atc, pyACL, numpy and CANN's version, without touching the device."""
    where = shutil.which("atc")
    yield Finding(
        "atc", where or "not on PATH: source /usr/local/Ascend/ascend-toolkit/set_env.sh", bool(where)
    )
    yield Finding(
        "CANN", f"{atc.cann_version()} (ASCEND_TOOLKIT_HOME={os.environ.get('ASCEND_TOOLKIT_HOME', '')})"
    )
    major = int(np.__version__.split(".")[0])
    yield Finding(
        "numpy",
        np.__version__
        + ("" if major < 2 else ": CANN's pyACL is built against numpy 1.x; pip install -e '.[ascend]'"),
        major < 2,
    )
    try:
        acl = import_acl()
    except AclError as exc:
        yield Finding("pyACL", str(exc), False)
        return
    soc = getattr(acl, "get_soc_name", None)
    yield Finding("pyACL", f"{getattr(acl, '__file__', acl)!s}; SoC {soc() if soc else 'unknown'}")


def window_report(weights: ModelWeights, ctx: int, make_backend: Callable[..., Any]) -> Iterator[Finding]:
    """Compile, load and run layer 0 on the NPU through `make_backend` (an AclBackend factory),
    with what the runtime reports about it, and its largest difference from the CPU backend."""
    layers = range(0, 1)
    try:
        backend = make_backend(weights, ctx=ctx, compile_profile_window=False)
    except PrimaError as exc:
        yield Finding("device", str(exc), False)
        return
    try:
        try:
            art = backend.compile(layers)
            yield Finding("compile", f"layer 0 -> {art.om} ({art.directory / 'atc.cmd'})")
            window = backend.load_window(layers)
        except PrimaError as exc:
            yield Finding("compile/load", str(exc), False)
            return
        yield from _described(backend, window)
        for attr, name in ((DDR_MEM, "DDR"), (HBM_MEM, "HBM")):
            free, total, ret = backend.runtime.acl.rt.get_mem_info(attr)
            yield Finding(
                f"get_mem_info {name}", f"free {free >> 20} MiB of {total >> 20} MiB (ret {ret})", ret == 0
            )
        try:
            diff = _against_cpu(backend, window, layers, ctx)
        except PrimaError as exc:
            yield Finding("run", str(exc), False)
        else:
            yield Finding(
                "run vs CPU", f"largest |hidden difference| {diff:.4g} (fp16 projections: ~1e-2 expected)"
            )
        backend.release_window(window)
    finally:
        backend.close()


def _described(backend: Any, window: Any) -> Iterator[Finding]:
    """The model's inputs, outputs and gears as the runtime reports them."""
    mdl, desc = backend.runtime.acl.mdl, window.model.desc
    yield Finding("inputs", ", ".join(window.model.inputs))
    raw = [mdl.get_output_name_by_index(desc, i) for i in range(len(window.model.outputs))]
    yield Finding("outputs", ", ".join(raw))
    count, ret = mdl.get_input_dynamic_gear_count(desc, -1)
    yield Finding("gears", f"{count} (ret {ret})", ret == 0 and count == len(backend.gears))
    if ret == 0 and count:
        dims, ret = mdl.get_input_dynamic_dims(desc, -1, count)
        for gear in dims if ret == 0 else []:
            yield Finding("gear", f"dimCount {gear['dimCount']}: {gear['dims']}")
    yield Finding("dynamic dims input", DYNAMIC_DIMS_INPUT, DYNAMIC_DIMS_INPUT in window.model.inputs)


def _against_cpu(backend: Any, window: Any, layers: range, ctx: int) -> float:
    """The largest difference between the NPU's and the CPU's (its host backend, exact) hidden
    states for a prefill of TOKENS and one decode step."""
    cpu = backend.host
    ids = TOKENS % backend.config.vocab_size
    kv, cpu_kv = backend.new_kv(ctx, layers), cpu.new_kv(ctx, layers)
    cpu_window = cpu.load_window(layers)
    diff = 0.0
    for tokens, positions in ((ids, np.arange(len(ids))), (ids[:1], np.array([len(ids)]))):
        h = backend.embed(tokens)
        got = backend.run_window(window, h, positions, kv)
        want = cpu.run_window(cpu_window, h, positions, cpu_kv)
        diff = max(diff, float(np.abs(got - want).max()))
    kv.free()
    cpu.release_window(cpu_window)
    return diff
