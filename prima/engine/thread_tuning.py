"""Choose the compute threads and how idle OpenMP workers wait, by timing a real decode step here.

A decode step launches ~100 small parallel regions. How much a launch costs depends on how the
pool's workers wait between them, and that differs by machine: where a sleeping worker is woken
through the kernel (OMP_WAIT_POLICY=passive) a launch can cost tens of times what it costs a
spinning one, enough for two threads to decode slower than one (docs/performance.md has the
numbers). Spinning for ever is no answer either: an idle daemon would burn a core of somebody's
laptop, and workers spinning on a busy machine starve each other. The middle way is a bounded
spin (GOMP_SPINCOUNT iterations, a few tenths of a millisecond, then sleep): launches within a
token, microseconds apart, find their workers awake, and a daemon waiting for work sleeps almost
at once. Longer spins (libgomp's default, ~3 ms) gain no decode speed and cost prefill, whose
Python tile threads compete with the spinning workers.

Which of 1 thread, N threads spinning briefly, N threads sleeping is fastest is measured, not
guessed (and on a CPU with cores of two kinds, big.LITTLE as on RK3588 or a phone, the same on
the big cores alone, the process pinned to them: a step waits for its slowest thread, so little
cores can slow it down): each candidate runs in its own process (libgomp reads its settings
once, when it loads), times decode steps of the model about to run, and the winner is kept in
the kernel cache, keyed on the CPU, the cores this process may use and the model. `prima tune`
measures again and prints the table. N threads are chosen only if faster than one.

Applying a choice changes only what prima.kernels.thread_env set by default; wait settings the user
exported are kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from prima.backends.decode_threads import FIXED_ENV
from prima.errors import PrimaError
from prima.kernels import compile_cache, thread_env

log = logging.getLogger("prima.engine")

SPIN = "spin"
PASSIVE = "passive"
# A tenth of libgomp's own default (300000, ~3 ms): covers the gaps between a token's launches.
SPIN_COUNT = "30000"
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
TUNING_ENV = "PRIMA_THREAD_TUNING"
# A candidate this close to the fastest counts as a tie; ties go to fewer threads, then to
# sleeping workers (both leave more of the machine to its owner).
TIE = 0.03
MEASURE_TIMEOUT_S = 300.0
# Measurements taken while other processes kept more than this share of the cores busy are used
# once but not recorded: beside a test suite or a compile, fewer threads win, and a record would
# keep that choice after the machine is quiet again.
MAX_OTHERS_BUSY = 0.25
# How long the machine's load is sampled before measuring: when other processes already keep it
# busy, measuring would take far longer (35-60 s beside one busy core, against ~10 s) to give a
# choice that may not be kept, so the start goes ahead on the defaults instead.
LOAD_SAMPLE_S = 0.5
# Where Linux says how fast each core is (cpu<N>/cpu_capacity, 1024 for the fastest kind), on
# arm64 with cores of more than one kind; x86 and most VMs have no such file.
CPU_SYSFS = Path("/sys/devices/system/cpu")
MEASURE_BYTES = 256 << 20  # weights one timed step reads at most (a window of a big model)
WARM_STEPS = 4
TIMED_STEPS = 12
ROUNDS = 3


_applied: ThreadSetting | None = None


class TuningError(PrimaError):
    """A measurement run failed; the message carries its last words."""


@dataclass(frozen=True)
class ThreadSetting:
    """How many compute threads, how idle workers wait (SPIN: briefly, then sleep), and the
    cores the process is pinned to (empty: not pinned)."""

    threads: int
    wait: str
    cpus: tuple[int, ...] = ()

    def env(self) -> dict[str, str | None]:
        """The environment that selects this setting (None: unset the variable)."""
        if self.wait == SPIN:
            return {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": SPIN_COUNT}
        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}

    def describe(self) -> str:
        where = f" on big cores {','.join(map(str, self.cpus))}" if self.cpus else ""
        if self.threads == 1:
            return "1 thread" + where
        waits = "spin briefly then sleep" if self.wait == SPIN else "sleep"
        return f"{self.threads} threads{where}, workers {waits}"


@dataclass(frozen=True)
class Measurement:
    setting: ThreadSetting
    ms_per_step: float


def usable_cpus() -> frozenset[int]:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(max(1, os.cpu_count() or 1)))


def usable_cores() -> int:
    return max(1, len(usable_cpus()))


def cpu_capacities(root: Path = CPU_SYSFS) -> dict[int, int]:
    """Each core's capacity as Linux reports it under `root` (cpu<N>/cpu_capacity); {} where
    it does not."""
    out: dict[int, int] = {}
    for path in root.glob("cpu[0-9]*/cpu_capacity"):
        try:
            out[int(path.parent.name.removeprefix("cpu"))] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def big_cores(capacities: Mapping[int, int], usable: Collection[int]) -> tuple[int, ...]:
    """The usable cores faster than the slowest kind among them, when they are of more than one
    kind (RK3588: its four A76 beside four A55; a phone's prime and middle cores beside its
    little ones); () when all are alike or a usable core's capacity is unknown."""
    caps = [capacities.get(cpu) for cpu in usable]
    if not caps or None in caps or len(set(caps)) < 2:
        return ()
    slowest = min(c for c in caps if c is not None)
    return tuple(sorted(cpu for cpu in usable if capacities[cpu] > slowest))


def candidates(cores: int, big: Sequence[int] = ()) -> list[ThreadSetting]:
    """1 thread, and with more cores all of them with each wait policy; with `big` cores, also
    those alone (the process pinned to them), each wait policy where they are several."""
    out = [ThreadSetting(1, PASSIVE)]
    if cores > 1:
        out += [ThreadSetting(cores, SPIN), ThreadSetting(cores, PASSIVE)]
    pinned = tuple(big)
    if len(pinned) > 1:
        out += [ThreadSetting(len(pinned), SPIN, pinned), ThreadSetting(len(pinned), PASSIVE, pinned)]
    elif pinned:
        out.append(ThreadSetting(1, PASSIVE, pinned))
    return out


def choose(measured: Sequence[Measurement]) -> ThreadSetting:
    """The fastest setting; among those within TIE of it, fewer threads, then sleeping workers."""
    if not measured:
        raise ValueError("no measurements to choose from")
    best = min(m.ms_per_step for m in measured)
    close = [m.setting for m in measured if m.ms_per_step <= best * (1 + TIE)]
    return min(close, key=lambda s: (s.threads, s.wait != PASSIVE))


def record_path(fingerprint: str, cores: int) -> Path:
    """Where the choice for this model, CPU and core count is kept: beside the kernels compiled
    from the same sources for the same CPU, so new kernels are measured again."""
    return compile_cache.cache_dir() / f"threads-{compile_cache.target_key()}-{cores}-{fingerprint[:16]}.json"


def load_record(path: Path) -> tuple[ThreadSetting, list[Measurement]] | None:
    def setting(raw: dict) -> ThreadSetting:
        return ThreadSetting(
            int(raw["threads"]), str(raw["wait"]), tuple(int(c) for c in raw.get("cpus", ()))
        )

    try:
        raw = json.loads(path.read_text())
        chosen = setting(raw["chosen"])
        measured = [Measurement(setting(m["setting"]), float(m["ms_per_step"])) for m in raw["measured"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return chosen, measured


def save_record(path: Path, chosen: ThreadSetting, measured: Sequence[Measurement]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"chosen": asdict(chosen), "measured": [asdict(m) for m in measured]}, indent=1)
    )
    os.replace(tmp, path)


def measure(
    model: str | os.PathLike[str], setting: ThreadSetting, timeout_s: float = MEASURE_TIMEOUT_S
) -> float:
    """ms per decode step with `setting`, timed in a child process that starts with its env
    (and pinned to its cores)."""
    env = dict(os.environ)
    for key, value in setting.env().items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PRIMA_THREAD_ENV"] = "off"  # the child's pools are set up by exactly this environment
    env[FIXED_ENV] = "fixed"  # time this count, not what decode would move to under load
    for key in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(key, "1")
    cmd = [
        sys.executable,
        "-m",
        "prima.engine.thread_tuning",
        "--measure",
        str(model),
        "--threads",
        str(setting.threads),
        *(("--cpus", ",".join(map(str, setting.cpus))) if setting.cpus else ()),
    ]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise TuningError(
            f"timing a decode step with {setting.describe()} took over {timeout_s:.0f} s"
        ) from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-10:])
        raise TuningError(f"timing a decode step with {setting.describe()} failed:\n{tail}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if setting.cpus and tuple(result["cpus"]) != setting.cpus:
        raise TuningError(f"timing a decode step with {setting.describe()} ran on cores {result['cpus']}")
    return float(result["ms_per_step"])


def tune(
    model: str | os.PathLike[str],
    fingerprint: str,
    *,
    cores: int | None = None,
    refresh: bool = False,
    cpu_root: Path = CPU_SYSFS,
    readings: Callable[[], tuple[float, float, float]] | None = None,
) -> tuple[ThreadSetting, list[Measurement], bool]:
    """The setting for this model here: recorded, or measured now (and recorded if the machine
    stayed quiet). Where other processes already keep the cores busy, nothing is measured (unless
    `refresh`, as `prima tune` asks): the default, all threads sleeping between launches, with no
    measurements. Returns the setting, its measurements and whether they were taken by this
    call. `cpu_root` is where the cores' capacities are read (tests point it at a made-up tree);
    `readings`: see OthersLoad (read twice before measuring, twice around it)."""
    cores = cores or usable_cores()
    big = big_cores(cpu_capacities(cpu_root), usable_cpus())
    path = record_path(fingerprint, cores)
    if not refresh:
        found = load_record(path)
        if found is not None:
            return found[0], found[1], False
    with compile_cache.exclusive():  # daemons starting together measure once, not side by side
        if not refresh:
            found = load_record(path)
            if found is not None:
                return found[0], found[1], False
        busy = 0.0 if refresh else _others_busy_now(readings)
        if busy > MAX_OTHERS_BUSY:
            default = ThreadSetting(cores, PASSIVE)
            log.warning(
                "other processes keep %.0f%% of the cores busy: starting with %s, without timing the "
                "choices (decode moves to fewer threads by itself if they are faster); a start on a "
                "quiet machine, or `prima tune`, measures them",
                100 * busy,
                default.describe(),
            )
            return default, [], False
        with OthersLoad(readings) as load:
            measured = [Measurement(s, measure(model, s)) for s in candidates(cores, big)]
        chosen = choose(measured)
        if load.busy_share() <= MAX_OTHERS_BUSY:
            save_record(path, chosen, measured)
        else:  # e.g. a test suite or a compile beside it: right for now, wrong to keep
            log.warning(
                "other processes kept %.0f%% of the cores busy while threads were timed: using %s "
                "for this run without recording it (the next start measures again)",
                100 * load.busy_share(),
                chosen.describe(),
            )
    return chosen, measured, True


def _others_busy_now(readings: Callable[[], tuple[float, float, float]] | None) -> float:
    """The share of the cores other processes keep busy, over LOAD_SAMPLE_S from now."""
    with OthersLoad(readings) as load:
        time.sleep(LOAD_SAMPLE_S)
    return load.busy_share()


class OthersLoad:
    """How busy the machine's cores were with other processes' work over a `with` block: the
    system's busy CPU time less this process's and its children's (the measuring runs), as a
    share of the cores' wall time. Hypervisor steal counts as busy. `readings` (tests inject
    their own) returns the wall clock, the system's busy CPU time and ours, in seconds."""

    def __init__(self, readings: Callable[[], tuple[float, float, float]] | None = None) -> None:
        self._readings = readings or _cpu_readings

    def __enter__(self) -> OthersLoad:
        self._t0, self._system0, self._ours0 = self._readings()
        return self

    def __exit__(self, *exc: object) -> None:
        t1, system1, ours1 = self._readings()
        self._wall = t1 - self._t0
        self._others = max(0.0, (system1 - self._system0) - (ours1 - self._ours0))

    def busy_share(self) -> float:
        cores = os.cpu_count() or 1
        return self._others / (self._wall * cores) if self._wall > 0 else 0.0


def _cpu_readings() -> tuple[float, float, float]:
    return time.monotonic(), _system_busy_s(), _own_cpu_s()


def _system_busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_cpu_s() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def apply(setting: ThreadSetting) -> bool:
    """Pin this process to `setting`'s cores, if it names any, and put its wait policy into the
    environment, where prima set the default and the user did not choose; True if the pool will
    run with both. libgomp reads the variables once, when numba first starts its pool, and its
    workers inherit the affinity of the thread that starts them, so this must run before a model
    is loaded."""
    if _pool_started():
        log.debug("numba's thread pool is running already; its wait policy stays")
        return False
    if setting.cpus and not usable_cpus().issuperset(setting.cpus):  # a record from another cpuset
        log.warning("cannot pin to cores %s, outside this process's cpuset; not pinned", setting.cpus)
    elif setting.cpus:
        # This thread's mask, inherited by every thread started after: numba's workers, prefill's
        # tile threads, the daemon's compute and gRPC threads.
        os.sched_setaffinity(0, setting.cpus)
    if any(key in os.environ and key not in thread_env.APPLIED for key in WAIT_KEYS):
        log.info("keeping the OpenMP wait settings from the environment")
        return False
    for key, value in setting.env().items():
        if value is None:
            os.environ.pop(key, None)
            thread_env.APPLIED.discard(key)
        else:
            os.environ[key] = value
            thread_env.APPLIED.add(key)
    return True


def tuned_setting(
    model_path: str | os.PathLike[str],
    on_stage: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> ThreadSetting | None:
    """The measured setting for this model, applied to this process (see `apply`): the fastest,
    or with `threads` given the fastest wait policy for that many. None when there is nothing
    to choose (one thread), PRIMA_THREAD_TUNING=off, the model cannot be read or the measurement
    failed (said in a warning); numba's and prima's defaults then stay."""
    global _applied
    if os.environ.get(TUNING_ENV) == "off" or threads == 1:
        return None
    from prima.model.gguf_file import GGUFFile

    try:
        with GGUFFile(model_path) as gguf:
            fingerprint = gguf.fingerprint()
    except (OSError, PrimaError):
        return None
    cores = usable_cores()
    if on_stage and load_record(record_path(fingerprint, cores)) is None:
        big = big_cores(cpu_capacities(), usable_cpus())
        also = f" and on the {len(big)} big cores alone" if big else ""
        on_stage(f"timing decode with 1 and {cores} threads{also}, once for this model and CPU (~10 s)")
    try:
        chosen, measured, fresh = tune(model_path, fingerprint, cores=cores)
    except TuningError as exc:  # only speed depends on the choice: run on the defaults instead
        log.warning("%s; running with the default threads (prima tune measures again)", exc)
        return None
    if fresh and on_stage:
        on_stage("chose " + chosen.describe() + ": " + format_measurements(measured))
    if threads is not None:
        same = [m for m in measured if m.setting.threads == threads and not m.setting.cpus]
        chosen = choose(same) if same else ThreadSetting(threads, PASSIVE)
    if apply(chosen):
        _applied = chosen
    return chosen


def applied() -> ThreadSetting | None:
    """The setting this process runs with, if tuned_setting applied one."""
    return _applied


def format_measurements(measured: Sequence[Measurement]) -> str:
    return ", ".join(f"{m.setting.describe()} {m.ms_per_step:.1f} ms" for m in measured)


def _pool_started() -> bool:
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(parallel is not None and getattr(parallel, "_is_initialized", False))


def _time_decode(model: str, threads: int) -> float:
    """Median ms of one decode step of `model` (the whole model when small, else a window of
    its first layers of ~MEASURE_BYTES), with `threads` threads."""
    import numpy as np

    from prima.forward.loader import load_model

    loaded = load_model(model, threads=threads, download=False)
    net = loaded.model
    cfg = net.config
    per_layer = max(1, sum(loaded.gguf.tensors[n].n_bytes for n in loaded.weights.layer_tensor_names(0)))
    n_layers = max(1, min(cfg.n_layers, MEASURE_BYTES // per_layer))
    whole = n_layers == cfg.n_layers
    steps = WARM_STEPS + ROUNDS * TIMED_STEPS
    cache = net.new_cache(steps + 1, range(0, n_layers))
    token = np.array([1], dtype=np.int64)
    times: list[float] = []
    for step in range(steps):
        t0 = time.perf_counter()
        h = net.embed(token)
        h = net.forward_layers(h, np.array([step]), 0, n_layers, cache)
        if whole:
            net.output_logits(h[-1:])
        times.append(time.perf_counter() - t0)
    timed = times[WARM_STEPS:]
    rounds = [sum(timed[i : i + TIMED_STEPS]) / TIMED_STEPS for i in range(0, len(timed), TIMED_STEPS)]
    return statistics.median(rounds) * 1000.0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prima.engine.thread_tuning", description=__doc__)
    p.add_argument("--measure", required=True, metavar="MODEL", help="model name or GGUF path to time")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--cpus", help="comma-separated cores to pin the process to before timing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.cpus:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    ms = _time_decode(args.measure, args.threads)
    cpus = sorted(usable_cpus())
    sys.stdout.write(json.dumps({"ms_per_step": ms, "cpus": cpus}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
