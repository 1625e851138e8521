"""`prima bench`: prompt processing and generation speed, and peak memory, of prima on this device
and, when llama-cpp-python is installed, of llama.cpp on the same GGUF in the same run.

Each engine runs in its own worker process (so each one's peak RSS is its own); the parent
alternates repetitions between them, so both see the same machine load, and reports medians.
`--busy-cores K` keeps K cores busy with other processes meanwhile: a laptop in use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing import Pipe, get_context
from multiprocessing.connection import Connection
from pathlib import Path

from prima.backends.decode_threads import FIXED_ENV
from prima.backends.modes import cpu_mode
from prima.cli.arg_types import non_negative_int, positive_int
from prima.engine.thread_tuning import tuned_setting
from prima.errors import InputError
from prima.kernels import thread_env
from prima.model.registry import DEFAULT_MODEL, resolve_model

# Seconds between two engines' runs: an engine's idle OpenMP workers spin after its run (libgomp's
# default, up to tens of milliseconds on a CPU whose pause instruction is slow), and they would
# take a core from the other engine's next prefill. Both engines get the same pause.
SETTLE_S = 0.2


@dataclass
class EngineResult:
    """Medians over the repetitions; `runs` keeps every repetition's (pp tok/s, tg tok/s)."""

    engine: str
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    ms_per_token: float = 0.0
    peak_rss_mib: float = 0.0
    rss_anon_mib: float = 0.0  # private memory at the end: weights served from the mmap stay out
    rss_file_mib: float = 0.0  # file-backed pages mapped (the GGUF in the page cache)
    runs: list[tuple[float, float]] = field(default_factory=list)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="measure prima (and llama.cpp, if installed) on a model", description=__doc__
    )
    p.add_argument(
        "-m",
        "--model",
        action="append",
        help=f"model name or GGUF path, repeatable (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=positive_int,
        default=None,
        help="compute threads at most (default: all cores; decode runs fewer while other processes keep cores busy)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for prefill (default 128)")
    p.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per repetition (default 32)")
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions per engine (default 5)")
    p.add_argument("--no-llama", action="store_true", help="measure prima only")
    p.add_argument(
        "--busy-cores",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="keep K cores busy with other processes while measuring (a device in use; default 0)",
    )
    p.add_argument(
        "--fixed-threads",
        action="store_true",
        help="keep prima's decode at --threads instead of re-choosing it as the load changes",
    )
    p.add_argument(
        "--exact", action="store_true", help="run prima in exact mode (float32 activations; default q8)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    threads = args.threads or os.cpu_count() or 1
    if args.reps < 1 or args.prompt_tokens < 1 or args.gen_tokens < 1:
        raise InputError("--reps, --prompt-tokens and --gen-tokens must be positive")
    have_llama = not args.no_llama and _llama_cpp_available()
    mode = cpu_mode(args.exact)
    report: dict = {
        "machine": _machine(),
        "threads": threads,
        "prima_mode": mode,
        "busy_cores": args.busy_cores,
        "prima_decode_threads": "fixed" if args.fixed_threads else "adaptive",
        "models": [],
    }
    if not have_llama and not args.no_llama:
        report["note"] = "llama-cpp-python is not installed (pip install 'prima[bench]'): prima numbers only"
    for name in args.model or [DEFAULT_MODEL]:
        path = resolve_model(name)
        engines = ["prima", "llama.cpp"] if have_llama else ["prima"]
        # Both engines get the same thread count; prima's workers wait as measured best here for
        # that count (prima tune), as `prima run` would run them.
        _warm_kernel_cache(get_context("spawn"), path, threads, mode)
        setting = tuned_setting(path, threads=threads)
        wait = setting.wait if setting else "default"
        with _busy(args.busy_cores):
            results = _bench_model(
                path,
                engines,
                threads,
                mode,
                args.prompt_tokens,
                args.gen_tokens,
                args.reps,
                args.fixed_threads,
            )
        entry: dict = {"model": path.name, "prima_wait": wait, "results": [asdict(r) for r in results]}
        if have_llama:
            p, ll = results
            entry["ratios"] = {
                "decode": p.decode_tok_s / ll.decode_tok_s,
                "prefill": p.prefill_tok_s / ll.prefill_tok_s,
                "peak_rss": p.peak_rss_mib / ll.peak_rss_mib,
            }
        report["models"].append(entry)
        if not args.json:
            _print_model(entry, threads, args.prompt_tokens, args.busy_cores, args.fixed_threads)
    report["machine"]["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(report, indent=2))
    elif "note" in report:
        print(f"note: {report['note']}")
    return 0


def _bench_model(
    path: Path,
    engines: list[str],
    threads: int,
    mode: str,
    n_prompt: int,
    n_gen: int,
    reps: int,
    fixed_threads: bool = False,
) -> list[EngineResult]:
    workers = []
    for engine in engines:
        parent, child = Pipe()
        argv = [engine, str(path), str(threads), mode, str(n_prompt + n_gen + 8), str(child.fileno())]
        # llama.cpp runs with the user's environment, not prima's thread-pool defaults (a passive
        # OpenMP wait would slow its per-node barriers and bias the comparison).
        env = _without(thread_env.APPLIED) if engine != "prima" else dict(os.environ)
        if engine == "prima" and fixed_threads:
            env[FIXED_ENV] = "fixed"
        proc = subprocess.Popen(
            [sys.executable, "-m", "prima.cli.bench_worker", *argv], env=env, pass_fds=(child.fileno(),)
        )
        child.close()  # so that a worker that dies shows up as EOF here, not as a hang
        workers.append((engine, proc, parent))
    try:
        prompt = _recv(workers[0][2])  # prima's worker tokenizes the prompt; llama.cpp reuses the ids
        for _, _, conn in workers[1:]:
            _recv(conn)
        ids = prompt[:n_prompt]
        for _, _, conn in workers:  # warm-up: numba compile / load, page cache
            conn.send(("run", ids, 4))
            _recv(conn)
        runs: dict[str, list[tuple[float, float]]] = {e: [] for e in engines}
        for _ in range(reps):
            for engine, _, conn in workers:
                time.sleep(SETTLE_S)  # the other engine's idle OpenMP workers stop spinning
                conn.send(("run", ids, n_gen))
                runs[engine].append(_recv(conn))
        results = []
        for engine, proc, conn in workers:
            conn.send(("stop",))
            peak, anon, file_ = _recv(conn)
            proc.wait(timeout=60)
            pp = statistics.median(r[0] for r in runs[engine])
            tg = statistics.median(r[1] for r in runs[engine])
            results.append(EngineResult(engine, pp, tg, 1000.0 / tg, peak, anon, file_, runs[engine]))
        return results
    finally:
        for _, proc, _ in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def _busy(cores: int) -> Iterator[None]:
    """`cores` processes spinning at normal priority (an application in use) for the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def _warm_kernel_cache(ctx, path: Path, threads: int, mode: str) -> None:
    """Compile prima's kernels into numba's disk cache in a throwaway process, so that the
    measured worker loads them as a later `prima run` does. llama.cpp's compiler ran at install
    time, outside its worker; without this, a first bench after installing or editing a kernel
    would count LLVM compiling (~100 MiB more peak RSS, seconds of time) against prima."""
    proc = ctx.Process(target=_warm_worker, args=(str(path), threads, mode))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise InputError(f"warming prima's kernel cache failed (exit code {proc.exitcode})")


def _warm_worker(path: str, threads: int, mode: str) -> None:
    from prima.engine.local import LocalEngine
    from prima.forward.loader import load_model

    loaded = load_model(path, threads=threads, mode=mode)
    engine = LocalEngine(loaded.model, n_ctx=32)
    engine.forward(list(range(1, 17)))  # a prefill batch (int8 GEMM, or tiled BLAS in exact mode)
    engine.forward([1])  # a decode step (fused block, int8 or exact matvec)


def _without(keys: set[str]) -> dict[str, str]:
    """os.environ without `keys`, and with prima's defaults off, for a worker of another engine."""
    env = {k: v for k, v in os.environ.items() if k not in keys}
    env["PRIMA_THREAD_ENV"] = "off"
    return env


def _recv(conn: Connection):  # whatever the worker sent
    try:
        msg = conn.recv()
    except EOFError:
        raise InputError(
            "a benchmark worker died without an answer (crashed? a llama.cpp built for another CPU "
            "dies with SIGILL); rerun with --no-llama to measure prima alone"
        ) from None
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise InputError(f"benchmark worker failed: {msg[1]}")
    return msg


def _llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}


def _print_model(entry: dict, threads: int, n_prompt: int, busy_cores: int = 0, fixed: bool = False) -> None:
    decode = "fixed" if fixed else "adaptive"
    busy = f", {busy_cores} cores kept busy" if busy_cores else ""
    print(
        f"{entry['model']}  ({threads} threads, prima's workers {entry['prima_wait']}, "
        f"prima's decode threads {decode}, prompt {n_prompt} tokens{busy})"
    )
    print(f"  {'engine':<10} {'prefill tok/s':>13} {'decode tok/s':>12} {'ms/token':>9} {'peak RSS MiB':>12}")
    for r in entry["results"]:
        print(
            f"  {r['engine']:<10} {r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f} "
            f"{r['ms_per_token']:>9.2f} {r['peak_rss_mib']:>12.0f}"
        )
    if "ratios" in entry:
        ra = entry["ratios"]
        print(
            f"  prima/llama.cpp: decode {ra['decode']:.2f}x, prefill {ra['prefill']:.2f}x, "
            f"peak RSS {ra['peak_rss']:.2f}x"
        )
