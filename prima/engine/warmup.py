"""Compile the kernels once, in a child process, before any process of prima runs them.

numba compiles a kernel on its first call and caches it on disk. Left to that, a first run
spends one to two minutes compiling in the middle of whatever it was doing: a daemon's Profile
call outlasts the coordinator's deadline, and a first `prima run --local` reports the compile as
generation speed. So the entry points call `ensure_compiled` first. While the cache for these
sources and this CPU is incomplete, it runs `python -m prima.engine.warmup MODEL`, which drives
the forward pass of that model (prefill and decode, int8 and exact) and the profiler's kernel
probe, so that every kernel is in the cache; then it marks the cache complete. Daemons started
together share one compile (a file lock). Every process then loads its kernels from the cache.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from prima.errors import PrimaError
from prima.kernels import compile_cache

log = logging.getLogger("prima.engine")

COMPILE_TIMEOUT_S = 1800.0
PREFILL_TOKENS = 24  # > 1 row (the tiled prefill kernels) and enough pairs for parallel attention
DECODE_STEPS = 2


class CompileError(PrimaError):
    """The kernels could not be compiled; the message carries the compiler's last words."""


def ensure_compiled(
    model: str | os.PathLike[str],
    on_stage: Callable[[str], None] | None = None,
    timeout_s: float = COMPILE_TIMEOUT_S,
) -> bool:
    """Make sure numba's cache holds every kernel prima runs, compiled for this CPU from these
    sources; True when this call compiled them. `on_stage` hears one line before and after."""
    if compile_cache.is_complete():
        return False
    with compile_cache.exclusive():
        if compile_cache.is_complete():  # another process compiled while this one waited
            return False
        if on_stage:
            on_stage("compiling kernels for this CPU, once (1-2 min; later runs load them from the cache)")
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "prima.engine.warmup", str(model)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise CompileError(f"compiling the kernels took over {timeout_s:.0f} s; try again") from None
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise CompileError(f"compiling the kernels failed (exit code {done.returncode}):\n{tail}")
        compile_cache.mark_complete()
        if on_stage:
            on_stage(
                f"kernels compiled in {time.monotonic() - t0:.0f} s, cached in {compile_cache.cache_dir()}"
            )
        return True


def exercise(model: str | os.PathLike[str]) -> None:
    """Call every kernel the forward pass and the profiler call, with the argument types they
    pass, so that numba compiles (and caches) each of them."""
    import numpy as np

    from prima.engine.local import LocalEngine
    from prima.forward.loader import load_model
    from prima.scheduler.kernel_bench import kernel_flops
    from prima.scheduler.profile import ModelProfile

    for mode in ("q8", "exact"):
        loaded = load_model(model, mode=mode, download=False)
        engine = LocalEngine(loaded.model, n_ctx=PREFILL_TOKENS + DECODE_STEPS)
        logits = engine.forward(np.arange(PREFILL_TOKENS) % loaded.model.config.vocab_size)
        for _ in range(DECODE_STEPS):
            logits = engine.forward([int(np.argmax(logits))])
    profile = ModelProfile.from_gguf(loaded.gguf)
    for fmt in sorted({"F32", *profile.layer_flops, *profile.output_flops}):
        kernel_flops(fmt, repeats=1, budget_s=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prima.engine.warmup", description=__doc__)
    p.add_argument("model", help="model name or GGUF path whose forward pass is compiled")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    exercise(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
