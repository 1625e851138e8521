"""Compile the kernels once, in a child process, before any process of prima runs them.

numba compiles a kernel on its first call and caches it on disk. Left to that, a first run
spends minutes (compile_cache.COMPILE_TIME) compiling in the middle of whatever it was doing: a daemon's Profile
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
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prima.errors import PrimaError
from prima.kernels import compile_cache

if TYPE_CHECKING:
    from prima.scheduler.profile_schema import ModelProfile

log = logging.getLogger("prima.engine")

COMPILE_TIMEOUT_S = 1800.0
PREFILL_TOKENS = 24  # > 1 row (the tiled prefill kernels) and enough pairs for parallel attention
# A prompt too long for the fused decode rows and too short for the glue's parallel kernels: the
# README's "The capital of France is" is 6 tokens, and without this its first prefill would
# compile for seconds on a fresh daemon.
SHORT_PROMPT_TOKENS = 6
DECODE_STEPS = 2


class CompileError(PrimaError):
    """The kernels could not be compiled; the message carries the compiler's last words."""


OnProgress = Callable[[int, int, str], None]  # (steps done, steps in all, the step now)
PROGRESS_PREFIX = "progress "  # the child's lines on stdout: "progress DONE TOTAL WHAT"


def ensure_compiled(
    model: str | os.PathLike[str],
    on_stage: Callable[[str], None] | None = None,
    timeout_s: float = COMPILE_TIMEOUT_S,
    on_progress: OnProgress | None = None,
) -> bool:
    """Make sure numba's cache holds every kernel `model` runs, compiled for this CPU from these
    sources: the common ones and those of each of its weight formats; True when this call
    compiled. `on_stage` hears one line before and after, `on_progress` each step of the
    compile as the child reaches it. Without numba nothing compiles (the numpy fallback)."""
    if not compile_cache.have_numba():
        return False
    formats = model_formats(model)
    if compile_cache.is_complete(formats):
        return False
    with compile_cache.exclusive():
        done = compile_cache.compiled_formats()
        if done is not None and done >= formats:  # another process compiled while this one waited
            return False
        if on_stage and done is None:
            on_stage(
                f"compiling kernels for this CPU, once ({compile_cache.COMPILE_TIME}; "
                "later runs load them from the cache)"
            )
        elif on_stage and done is not None:  # those compiled before load from the cache
            on_stage(f"compiling kernels for {', '.join(sorted(formats - done))}, once")
        t0 = time.monotonic()
        returncode, stderr = _run_child(
            [sys.executable, "-m", "prima.engine.warmup", str(model)], timeout_s, on_progress
        )
        if returncode is None:
            raise CompileError(f"compiling the kernels took over {timeout_s:.0f} s; try again")
        if returncode != 0:
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            raise CompileError(f"compiling the kernels failed (exit code {returncode}):\n{tail}")
        compile_cache.mark_complete(formats)
        if on_stage:
            on_stage(
                f"kernels compiled in {time.monotonic() - t0:.0f} s, cached in {compile_cache.cache_dir()}"
            )
        return True


def model_formats(model: str | os.PathLike[str]) -> frozenset[str]:
    """The ggml type names of `model`'s tensors that prima has kernels for: the formats its
    forward pass runs. Empty when the file's header cannot be read; a type prima cannot run is
    left out. Either way the model's own load reports what is wrong."""
    from prima.kernels.quants import SUPPORTED_QTYPES
    from prima.model.gguf_file import GGUFFile

    try:
        with GGUFFile(model) as gguf:
            return frozenset(t.qtype.name for t in gguf.tensors.values() if t.qtype in SUPPORTED_QTYPES)
    except (PrimaError, OSError):
        return frozenset()


def _run_child(cmd: list[str], timeout_s: float, on_progress: OnProgress | None) -> tuple[int | None, str]:
    """Run the compiling child, handing its progress lines to `on_progress`; its exit code
    (None: killed at `timeout_s`) and its stderr."""
    killed = threading.Event()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            with proc.stdout or open(os.devnull) as out:
                for line in out:  # ends when the child exits (or is killed)
                    step = _parse_progress(line)
                    if step is not None and on_progress is not None:
                        on_progress(*step)
            returncode = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # the caller's callback raised: the child goes too
                proc.kill()
                proc.wait()
        err.seek(0)
        return (None if killed.is_set() else returncode), err.read()


def _parse_progress(line: str) -> tuple[int, int, str] | None:
    if not line.startswith(PROGRESS_PREFIX):
        return None
    done, total, what = (line[len(PROGRESS_PREFIX) :].rstrip("\n").split(" ", 2) + ["", ""])[:3]
    try:
        return int(done), int(total), what
    except ValueError:
        return None


def exercise(model: str | os.PathLike[str], on_progress: OnProgress | None = None) -> None:
    """Call every kernel the forward pass, the profiler and Halda call, with the argument types
    they pass, so that numba compiles (and caches) each of them."""
    import numpy as np

    from prima.engine.local import LocalEngine
    from prima.forward.loader import load_model
    from prima.scheduler.kernel_bench import kernel_flops
    from prima.scheduler.profile_schema import ModelProfile

    modes = ("q8", "exact")
    loaded = load_model(model, mode=modes[0], download=False)
    profile = ModelProfile.from_gguf(loaded.gguf)
    formats = sorted({"F32", *profile.layer_flops, *profile.output_flops})
    steps = [
        *(f"forward pass ({mode})" for mode in modes),
        *(f"kernel probe {fmt}" for fmt in formats),
        "planner",
    ]
    say = on_progress or (lambda _done, _total, _what: None)
    matmuls = []
    for i, mode in enumerate(modes):
        say(i, len(steps), steps[i])
        loaded = load_model(model, mode=mode, download=False)
        vocab = loaded.model.config.vocab_size
        for prompt in (PREFILL_TOKENS, SHORT_PROMPT_TOKENS):
            engine = LocalEngine(loaded.model, n_ctx=prompt + DECODE_STEPS)
            logits = engine.forward(np.arange(prompt) % vocab)
            for _ in range(DECODE_STEPS):
                logits = engine.forward([int(np.argmax(logits))])
        matmuls.append(loaded.model.backend.matmul)
    for j, fmt in enumerate(formats, start=len(modes)):
        say(j, len(steps), steps[j])
        # Without a matmul, the scheduler's own probe; with each mode's, a daemon's profile.
        for matmul in (None, *matmuls):
            kernel_flops(fmt, repeats=1, budget_s=0.0, matmul_fn=matmul)
    say(len(steps) - 1, len(steps), steps[-1])
    _plan(profile)
    _other_activations()
    say(len(steps), len(steps), "done")


def _plan(model: ModelProfile) -> None:
    """Halda on a made-up ring of this model (two members short of memory), so that a
    coordinator's first plan loads the search from the cache instead of compiling it (~10 s)."""
    from prima.errors import PlanError
    from prima.scheduler import halda
    from prima.scheduler.profile_schema import DeviceProfile

    whole = max(model.n_layers * model.layer_bytes, 1)
    flops = dict.fromkeys({"F32", *model.layer_flops, *model.output_flops}, 1e10)

    def device(i: int, ram: int) -> DeviceProfile:
        return DeviceProfile(
            node_id=f"warm-up-{i}",
            ram_total_bytes=2 * whole,
            ram_available_bytes=ram,
            disk_read_bytes_per_s=1e9,
            mem_bandwidth_bytes_per_s=1e10,
            cpu_flops=flops,
            net_latency_ms=0.5,
        )

    try:
        halda.solve([device(0, 2 * whole), device(1, whole // 3), device(2, whole // 3)], model)
    except PlanError:  # only the compile matters here
        pass


def _other_activations() -> None:
    """The gated activations of every architecture, at decode and at prefill row counts, and the
    float16 weights' decode kernel: the cache is complete for all models, not only for the one
    that compiled it (a first prefill of Gemma after a SmolLM2 compile spent seconds and ~100
    MiB of RSS compiling GELU)."""
    import numpy as np

    from prima.kernels import ops_compiled

    for rows in (1, ops_compiled.PARALLEL_MIN_ROWS):
        gate_up = np.zeros((rows, 8), dtype=np.float32)
        for activation in ("gelu", "silu"):
            ops_compiled.glu(gate_up, 4, activation)
            ops_compiled.glu_in_place(gate_up.copy(), 4, activation)
    # float16, bfloat16 and float32 weights at decode (read-only, as mapped from a GGUF)
    from prima.kernels import drivers, float_weights

    halves = np.zeros((2, 32), dtype=np.uint16)
    halves.flags.writeable = False
    singles = np.zeros((2, 64), dtype=np.uint32)
    singles.flags.writeable = False
    for matvec, w in (
        (drivers.matvec_f16, halves),
        (float_weights.matvec_bf16, halves),
        (drivers.matvec_f32, singles),
    ):
        matvec(
            w, w[:0], w[:0], np.zeros((1, w.shape[1]), dtype=np.float32), np.empty((1, 2), dtype=np.float32)
        )


def _print_progress(done: int, total: int, what: str) -> None:
    sys.stdout.write(f"{PROGRESS_PREFIX}{done} {total} {what}\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prima.engine.warmup", description=__doc__)
    p.add_argument("model", help="model name or GGUF path whose forward pass is compiled")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    exercise(args.model, _print_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
