"""The original system's home cluster, emulated on one machine: four unequal devices running a
model ~2.2x their memory together, against llama.cpp alone on the best of them.

    python bench/bench_seeds.py [--size 3G] [--overhead 250M] [--disk-scale 10] [-n 8]
                                [--skip llama|ring] [--max-rounds K] [--json]

prima.cpp's table (docs/performance.md cites it): a Mac M1 (2.4 GiB free, 0.72 GB/s disk), a
laptop (4.1 GiB, 2.98 GB/s), a desktop (9.7 GiB, 3.17 GB/s) and a phone (1.9 GiB, 1.37 GB/s)
on Wi-Fi (3-7 ms, 320-610 Mbit/s) run Llama 3-70B Q4_K (~40 GB, 2.2x their 18.1 GiB) at
674 ms/token against llama.cpp's 10,120 on the desktop (15x). Here, scaled to this machine:

- memory: the model is a synthetic one of --size (`prima models synth`); each device's memory
  cgroup holds its share of size / 2.2 in the seeds' ratios, plus --overhead for the process
  itself (a Python daemon needs more than prima.cpp's; llama.cpp's device gets the same
  overhead, which favours llama.cpp);
- disk: each device's reads throttled (blkio) to its seed's speed / --disk-scale;
- links: each daemon behind a link shaper (prima.net.link_shaper; netem is absent here) with
  its seed's one-way delay and rate (the four links take 3, 4, 5 and 7 ms and 610, 450, 400 and
  320 Mbit/s: the published ranges, assigned by us);
- compute: the devices share this machine's cores (one thread each), so unlike the seeds' GPUs
  every device computes at the same, slower, speed.

Zero-config: Halda plans from what each daemon measures of itself (memory limit, disk speed,
link to its successor). Prints ms/token of both runs and their ratio, Halda's prediction
against the measurement, and per device the memory pressure: its limit, its peak use (page
cache included), the most anonymous memory it held (what other programs could not reclaim),
the memory left to them at that point, the major page faults and the bytes read from disk.
Needs root and cgroups v1 (memory, blkio). Numbers from a loaded machine say little: say so.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_scale import _cpu_name, run_llama, synth_model  # bench/ is on sys.path when run

from prima.cli.arg_types import parse_bytes
from prima.coordinator.emulate import EmulatedDevice, cgroups_writable, disk_of, drop_page_cache
from prima.coordinator.local_ring import LocalRing
from prima.net.link_shaper import LinkShape, LinkShaper

MiB = 1 << 20
GiB = 1 << 30
MODEL_OVER_MEMORY = 2.2  # the seeds' 40 GB model over their 18.1 GiB


@dataclass(frozen=True)
class SeedDevice:
    name: str
    free_gib: float
    disk_gb_per_s: float
    delay_ms: float
    mbit_per_s: float


SEEDS = (
    SeedDevice("m1", 2.4, 0.72, 3.0, 610.0),
    SeedDevice("laptop", 4.1, 2.98, 4.0, 450.0),
    SeedDevice("desktop", 9.7, 3.17, 5.0, 400.0),
    SeedDevice("phone", 1.9, 1.37, 7.0, 320.0),
)


@dataclass
class DeviceFigures:
    """One emulated device's memory pressure over a run."""

    name: str
    limit_mib: float
    peak_mib: float
    peak_anon_mib: float
    left_mib: float  # limit minus the most anonymous memory held: what other programs keep
    major_faults: int
    read_mib: float


@dataclass
class Result:
    name: str
    ms_per_token: float
    token_ids: list[int]
    devices: list[DeviceFigures]
    predicted_ms: float | None = None
    plan: str = ""
    extra: dict = field(default_factory=dict)


def memory_stat(dev: EmulatedDevice) -> dict[str, int]:
    """The cgroup's memory.stat counters (cgroups v1)."""
    out = {}
    for line in (dev.mem_dir / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.isdigit():
            out[key] = int(value)
    return out


class PressureWatch:
    """Samples each device's anonymous memory (every 0.2 s, on a thread) and counts its major
    faults from start to stop."""

    def __init__(self, devs: list[EmulatedDevice]) -> None:
        self.devs = devs
        self.peak_anon = [0] * len(devs)
        self._faults0 = [memory_stat(d).get("total_pgmajfault", 0) for d in devs]
        self._before = [d.read_bytes() for d in devs]
        for d in devs:
            d.reset_peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def _sample(self) -> None:
        for i, d in enumerate(self.devs):
            try:
                anon = memory_stat(d).get("total_rss", 0)
            except OSError:
                continue
            self.peak_anon[i] = max(self.peak_anon[i], anon)

    def stop(self) -> list[DeviceFigures]:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        figures = []
        for i, d in enumerate(self.devs):
            faults = memory_stat(d).get("total_pgmajfault", 0) - self._faults0[i]
            figures.append(
                DeviceFigures(
                    d.name,
                    d.mem_limit_bytes / MiB,
                    d.peak_bytes() / MiB,
                    self.peak_anon[i] / MiB,
                    (d.mem_limit_bytes - self.peak_anon[i]) / MiB,
                    faults,
                    (d.read_bytes() - self._before[i]) / MiB,
                )
            )
        return figures


def limits(model_bytes: int, overhead: int) -> list[int]:
    """Each seed's memory limit: its share of model / 2.2 in the seeds' ratios, plus overhead."""
    total = sum(s.free_gib for s in SEEDS)
    return [int(model_bytes / MODEL_OVER_MEMORY * s.free_gib / total) + overhead for s in SEEDS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ring(model: Path, args: argparse.Namespace, devs: list[EmulatedDevice]) -> Result:
    drop_page_cache()
    logs = Path(tempfile.mkdtemp(prefix="prima-seeds-"))
    link_ports = [free_port() for _ in devs]
    ring = LocalRing.start(
        len(devs),
        model,
        threads=1,
        preexec=[d.preexec() for d in devs],
        node_args=[["-v", "--link-port", str(p)] for p in link_ports],
        names=[s.name for s in SEEDS],
        log_dir=logs,
        plaintext=True,  # loopback only; `prima run` in another process has no share of this CA
    )
    shapers: list[LinkShaper] = []
    try:
        fronts = []
        for i, (address, link_port, seed) in enumerate(zip(ring.addresses, link_ports, SEEDS, strict=True)):
            host, port = address.rsplit(":", 1)
            front = f"127.0.0.{21 + i}"
            shape = LinkShape(delay_ms=seed.delay_ms, jitter_ms=0.5, mbit_per_s=seed.mbit_per_s)
            shapers.append(LinkShaper((front, int(port)), (host, int(port)), shape, seed=2 * i))
            shapers.append(LinkShaper((front, link_port), (host, link_port), shape, seed=2 * i + 1))
            fronts.append(f"{front}:{port}")
        drop_page_cache()  # the daemons mapped the file; start the run cold
        watch = PressureWatch(devs)
        # Discovered nodes (zero-config) are led by the one with the most memory for layers, the
        # others following in their order; --nodes keeps the order given, so give that one.
        head = max(range(len(SEEDS)), key=lambda i: SEEDS[i].free_gib)
        fronts = [fronts[head], *(f for i, f in enumerate(fronts) if i != head)]
        cmd = [sys.executable, "-m", "prima.cli.main", "-v", "run", "--nodes", ",".join(fronts)]
        cmd += ["-m", str(model), "-p", args.prompt, "-n", str(args.n), "--temp", "0", "--json"]
        cmd += ["-c", "256", "--reprofile"]  # the limits and throttles are new: measure afresh
        if args.max_rounds is not None:
            cmd += ["--max-rounds", str(args.max_rounds)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        figures = watch.stop()
        (logs / "coordinator.log").write_text(out.stderr)
        if out.returncode != 0:
            raise SystemExit(
                f"prima run --nodes failed ({out.returncode}): {out.stderr[-3000:]}; logs in {logs}"
            )
    finally:
        for s in shapers:
            s.close()
        ring.close()
    r = json.loads(out.stdout)
    plan = r.get("plan", {})
    windows = " ".join(
        f"{n['node_id']}:" + ",".join(f"[{w[0]},{w[1]})" for w in n["windows"]) for n in plan.get("nodes", [])
    )
    return Result(
        f"prima ring of {len(devs)}",
        r["timings"]["ms_per_token"],
        r["token_ids"],
        figures,
        plan.get("predicted_ms_per_token"),
        f"k={plan.get('rounds')} {windows}",
        {"logs": str(logs)},
    )


def run_llama_alone(model: Path, args: argparse.Namespace, dev: EmulatedDevice) -> Result:
    scale_args = argparse.Namespace(
        n=args.n, threads=2, timeout=args.timeout, prompt_words=0
    )  # bench_scale's worker: its short prompt, both cores (it has the machine to itself)
    drop_page_cache()
    watch = PressureWatch([dev])
    run = run_llama(model, scale_args, dev)
    figures = watch.stop()
    return Result(f"llama.cpp alone ({dev.name})", run.ms_per_token, run.token_ids, figures)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF to run (default: a synthetic model of --size)")
    p.add_argument("--size", default="3G", help="size of the synthetic model (default 3G)")
    p.add_argument(
        "--overhead", default="250M", help="memory added to each device for its process (default 250M)"
    )
    p.add_argument("--disk-scale", type=float, default=10.0, help="seeds' disk speeds divided by this")
    p.add_argument("-n", type=int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--skip", action="append", default=[], choices=("llama", "ring"))
    p.add_argument("--max-rounds", type=int, default=None, help="let Halda consider at most this many rounds")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before giving up")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.prompt = "The capital of France is"  # bench_scale's prompt, so both runs see the same ids

    why = cgroups_writable()
    if why:
        print(f"bench_seeds: skipped: {why}; it needs root and cgroups v1 (memory, blkio)", file=sys.stderr)
        return 0
    model = Path(args.model) if args.model else synth_model(args.size)
    mems = limits(model.stat().st_size, parse_bytes(args.overhead))
    disk = disk_of(model)

    def device(prefix: str, i: int) -> EmulatedDevice:
        bps = int(SEEDS[i].disk_gb_per_s * 1e9 / args.disk_scale)
        return EmulatedDevice(f"{prefix}-{SEEDS[i].name}", mems[i], bps, disk)

    results: list[Result] = []
    try:
        if "llama" not in args.skip:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print("llama-cpp-python is not installed (pip install -e '.[bench]')", file=sys.stderr)
            else:
                best = max(range(len(SEEDS)), key=lambda i: SEEDS[i].free_gib)
                dev = device("seeds-llama", best)
                try:
                    results.append(run_llama_alone(model, args, dev))
                finally:
                    dev.remove()
        if "ring" not in args.skip:
            devs = [device("seeds", i) for i in range(len(SEEDS))]
            try:
                results.append(run_ring(model, args, devs))
            finally:
                for d in devs:
                    d.remove()
    finally:
        drop_page_cache()
    report(results, model, mems, args)
    return 0


def report(results: list[Result], model: Path, mems: list[int], args: argparse.Namespace) -> None:
    cpu = _cpu_name()
    if args.json:
        print(
            json.dumps(
                {"cpu": cpu, "model": str(model), "limits": mems, "runs": [asdict(r) for r in results]}
            )
        )
        return
    size = model.stat().st_size
    print(
        f"{model.name} ({size / GiB:.2f} GiB) on 4 emulated devices of {sum(mems) / GiB:.2f} GiB in all "
        f"({size / (sum(mems) - len(mems) * parse_bytes(args.overhead)):.1f}x their memory for the model); "
        f"disks at 1/{args.disk_scale:g} of the seeds'; {args.n} tokens; CPU: {cpu}"
    )
    llama = next((r for r in results if r.name.startswith("llama")), None)
    for r in results:
        if not r.name.startswith("llama"):
            left = sum(d.left_mib for d in r.devices) * MiB
            print(f"the model is {size / left:.1f}x the memory the ring's processes left for it")
        ratio = f"  {llama.ms_per_token / r.ms_per_token:.2f}x llama.cpp" if llama and r is not llama else ""
        pred = ""
        if r.predicted_ms:
            pred = f"  Halda predicted {r.predicted_ms:.0f} (measured/predicted {r.ms_per_token / r.predicted_ms:.2f})"
        print(f"{r.name:<28} {r.ms_per_token:9.1f} ms/token{ratio}{pred}  {r.plan}")
        for d in r.devices:
            print(
                f"    {d.name:<20} limit {d.limit_mib:6.0f} MiB  peak {d.peak_mib:6.0f}  anon {d.peak_anon_mib:6.0f}  "
                f"left to others {d.left_mib:6.0f} ({100 * d.left_mib / d.limit_mib:.0f}%)  "
                f"major faults {d.major_faults:7d}  read {d.read_mib:7.0f} MiB"
            )
    same = {tuple(r.token_ids) for r in results}
    print(
        "greedy tokens identical"
        if len(same) == 1
        else f"greedy tokens differ: {[r.token_ids[:8] for r in results]}"
    )


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"[bench_seeds took {time.time() - t0:.0f} s]", file=sys.stderr)
    sys.exit(code)
