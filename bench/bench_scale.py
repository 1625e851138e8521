"""The case prima exists for: a model bigger than a device's memory. llama.cpp alone, prima alone
and a ring of N primad, each process in its own memory cgroup of the same size (and optionally
the same disk-read throttle), page cache dropped before each run, no memory flags anywhere:
Halda plans the ring from what each daemon finds about itself.

    python bench/bench_scale.py [--model PATH | --size 1.04G] [--nodes 3] [--mem 600M]
                                [--disk-mbps 200] [-n 16] [--prompt-words 300] [--threads 2] [--json]

Prints ms/token for each run, the ring's ratio against llama.cpp, Halda's predicted ms/token
against the measurement, and per process the peak memory (cgroup) and the bytes read from disk.
Needs root and cgroups v1 (memory, blkio); elsewhere it says why and exits. The synthetic model
(`prima models synth`) is written once into the cache and reused.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prima.cli.arg_types import parse_bytes
from prima.coordinator.emulate import EmulatedDevice, cgroups_writable, disk_of, drop_page_cache
from prima.coordinator.local_ring import LocalRing
from prima.model.registry import DEFAULT_MODEL, cache_dir, resolve_model
from prima.model.synth import spec_for_size, write_synth_model
from prima.net.client import NodeClient

PROMPT = "The capital of France is"
# --prompt-words N: a long prompt of these words repeated, to time prefill (a streaming ring
# reads its streamed layers once per micro-batch that reaches them apart from the others).
LONG_TEXT = (
    "The river bends past the old mill where the village keeps its records of every harvest, "
    "every flood and every wedding since the bridge was built of stone from the northern hills."
).split()
MiB = 1 << 20

LLAMA_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
path, prompt, n, threads, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_batch=64, use_mmap=True, verbose=False)
tokens = llm.tokenize(prompt.encode(), add_bos=True)
stamps = [time.perf_counter()]
ids = []
for tok in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
    stamps.append(time.perf_counter())
    ids.append(int(tok))
    if len(ids) >= n:
        break
decode = [b - a for a, b in zip(stamps[1:], stamps[2:])]
print(json.dumps({"ms_per_token": 1000 * sum(decode) / max(len(decode), 1),
                  "prefill_ms": 1000 * (stamps[1] - stamps[0]), "token_ids": ids}))
"""


@dataclass
class Run:
    name: str
    ms_per_token: float
    token_ids: list[int]
    peak_mib: list[float]
    read_mib: list[float]
    predicted_ms: float | None = None
    plan: str = ""
    extra: dict = field(default_factory=dict)
    prefill_ms: float | None = None  # the prompt, up to the first token


def prompt(args: argparse.Namespace) -> str:
    if not args.prompt_words:
        return PROMPT
    return " ".join(LONG_TEXT[i % len(LONG_TEXT)] for i in range(args.prompt_words))


def ctx(args: argparse.Namespace) -> int:
    """Context for the prompt and the tokens (a word is rarely more than two tokens)."""
    return max(256, 2 * args.prompt_words + args.n + 64)


def synth_model(size: str) -> Path:
    target = parse_bytes(size)
    path = cache_dir() / "synth" / f"synth-llama-{target // MiB}M-q4_1.gguf"
    if not path.exists():
        source = resolve_model(DEFAULT_MODEL)
        from prima.model.gguf_file import GGUFFile

        with GGUFFile(source) as gguf:
            vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
        spec = spec_for_size(target, vocab, n_layers=24, d_model=2048, ffn=8192, qtype="Q4_1")
        print(f"writing {path} ({spec.n_layers} layers)", file=sys.stderr)
        write_synth_model(path, spec, source)
    return path


def devices(prefix: str, n: int, mem: int, bps: int, disk: tuple[int, int]) -> list[EmulatedDevice]:
    return [EmulatedDevice(f"{prefix}{i}", mem, bps, disk) for i in range(n)]


def run_llama(model: Path, args: argparse.Namespace, dev: EmulatedDevice) -> Run:
    drop_page_cache()
    dev.reset_peak()
    before = dev.read_bytes()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            LLAMA_WORKER,
            str(model),
            prompt(args),
            str(args.n),
            str(args.threads),
            str(ctx(args)),
        ],
        capture_output=True,
        text=True,
        preexec_fn=dev.preexec(),
        timeout=args.timeout,
    )
    if out.returncode != 0:
        raise SystemExit(f"llama.cpp worker failed ({out.returncode}): {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return Run(
        "llama.cpp alone",
        r["ms_per_token"],
        r["token_ids"],
        [dev.peak_bytes() / MiB],
        [(dev.read_bytes() - before) / MiB],
        prefill_ms=r["prefill_ms"],
    )


def run_prima_single(model: Path, args: argparse.Namespace, dev: EmulatedDevice) -> Run:
    drop_page_cache()
    dev.reset_peak()
    before = dev.read_bytes()
    cmd = [sys.executable, "-m", "prima.cli.main", "run", "--local", "-m", str(model), "-p", prompt(args)]
    cmd += ["-n", str(args.n), "--temp", "0", "--json", "-t", str(args.threads), "-c", str(ctx(args))]
    out = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=dev.preexec(), timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"prima run --local failed ({out.returncode}): {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    return Run(
        "prima alone",
        r["timings"]["ms_per_token"],
        r["token_ids"],
        [dev.peak_bytes() / MiB],
        [(dev.read_bytes() - before) / MiB],
        prefill_ms=r["timings"]["prompt_ms"],
    )


def run_ring(model: Path, args: argparse.Namespace, devs: list[EmulatedDevice]) -> Run:
    drop_page_cache()
    logs = Path(tempfile.mkdtemp(prefix="prima-scale-"))
    ring = LocalRing.start(
        len(devs),
        model,
        threads=args.node_threads or args.threads,
        preexec=[d.preexec() for d in devs],
        log_dir=logs,
        extra_args=["-v", *args.primad_args],
        # Loopback only, and `prima run --nodes` runs in another process, which has no share of
        # this one's throwaway cluster CA: the daemons serve plaintext (primad allows it on loopback).
        plaintext=True,
    )
    try:
        drop_page_cache()  # the daemons mapped the file; start the run cold
        for d in devs:
            d.reset_peak()
        before = [d.read_bytes() for d in devs]
        cmd = [
            sys.executable,
            "-m",
            "prima.cli.main",
            "-v",
            "run",
            "--nodes",
            ",".join(ring.addresses),
            "-m",
            str(model),
        ]
        cmd += ["-p", prompt(args), "-n", str(args.n), "--temp", "0", "--json", "-c", str(ctx(args))]
        # --reprofile: the disk and memory a daemon sees here change from run to run (throttles,
        # limits), so a cached profile would plan for another machine; the coordinator asks the
        # nodes one at a time, so their measurements do not contend for the two cores.
        cmd.append("--reprofile")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        (logs / "coordinator.log").write_text(out.stderr)
        if out.returncode != 0:
            raise SystemExit(
                f"prima run --nodes failed ({out.returncode}): {out.stderr[-3000:]}; logs in {logs}"
            )
        r = json.loads(out.stdout)
        nodes = {}
        for node in ring.nodes:
            client = NodeClient(node.address)
            try:
                res = client.info().residency
            finally:
                client.close()
            if res is not None:
                nodes[node.node_id] = {
                    "pinned_layers": res.pinned_layers,
                    "read_mib": res.bytes_read / MiB,
                    "read_ms": res.read_ms,
                    "wait_ms": res.wait_ms,
                    "compute_ms": res.compute_ms,
                    "budget_mib": res.budget_bytes / MiB,
                }
    finally:
        ring.close()
    plan = r.get("plan", {})
    windows = " ".join(
        f"{n['node_id']}:" + ",".join(f"[{w[0]},{w[1]})" for w in n["windows"]) for n in plan.get("nodes", [])
    )
    return Run(
        f"prima ring of {len(devs)}",
        r["timings"]["ms_per_token"],
        r["token_ids"],
        [d.peak_bytes() / MiB for d in devs],
        [(d.read_bytes() - b) / MiB for d, b in zip(devs, before, strict=True)],
        plan.get("predicted_ms_per_token"),
        f"k={plan.get('rounds')} {windows}",
        {"logs": str(logs), "nodes": nodes, "hops": r.get("hops") or []},
        prefill_ms=r["timings"]["prompt_ms"],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF to run (default: a synthetic model of --size)")
    p.add_argument("--size", default="1.04G", help="size of the synthetic model (default 1.04G)")
    p.add_argument("--nodes", type=int, default=3, help="daemons in the ring (default 3)")
    p.add_argument("--mem", default="600M", help="memory limit of every process (default 600M)")
    p.add_argument(
        "--disk-mbps", type=float, default=0, help="disk-read throttle per process, MB/s (0 = none)"
    )
    p.add_argument("-n", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument(
        "--prompt-words",
        type=int,
        default=0,
        help="a prompt of this many words, to time prefill (default: 5)",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="threads of llama.cpp, prima alone and each daemon (default 2)"
    )
    p.add_argument(
        "--node-threads",
        type=int,
        default=0,
        help="threads of each daemon (default: --threads); on some CPUs one is faster (issue #14)",
    )
    p.add_argument("--skip", action="append", default=[], choices=("llama", "single", "ring"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before giving up")
    p.add_argument("--primad-arg", dest="primad_args", action="append", default=[], help="extra primad flag")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    why = cgroups_writable()
    if why:
        print(f"bench_scale: skipped: {why}; it needs root and cgroups v1 (memory, blkio)", file=sys.stderr)
        return 0
    model = Path(args.model) if args.model else synth_model(args.size)
    mem = parse_bytes(args.mem)
    bps = int(args.disk_mbps * 1e6)
    disk = disk_of(model)
    cpu = _cpu_name()
    runs: list[Run] = []
    try:
        if "llama" not in args.skip:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print(
                    "llama-cpp-python is not installed (pip install -e '.[bench]'): no llama.cpp row",
                    file=sys.stderr,
                )
            else:
                (dev,) = devices("llama", 1, mem, bps, disk)
                runs.append(run_llama(model, args, dev))
                dev.remove()
        if "single" not in args.skip:
            (dev,) = devices("single", 1, mem, bps, disk)
            runs.append(run_prima_single(model, args, dev))
            dev.remove()
        if "ring" not in args.skip:
            devs = devices("node", args.nodes, mem, bps, disk)
            runs.append(run_ring(model, args, devs))
            for d in devs:
                d.remove()
    finally:
        drop_page_cache()
    llama = next((r for r in runs if r.name.startswith("llama")), None)
    if args.json:
        print(
            json.dumps(
                {
                    "cpu": cpu,
                    "model": str(model),
                    "mem": mem,
                    "disk_bps": bps,
                    "runs": [asdict(r) for r in runs],
                }
            )
        )
        return 0
    print(
        f"{model.name}, {args.mem} per process, disk {args.disk_mbps or 'unthrottled'} MB/s, "
        f"{args.prompt_words or 5}-word prompt, {args.n} tokens, CPU: {cpu}"
    )
    print(
        f"{'run':<18} {'ms/token':>9} {'vs llama':>9} {'predicted':>10} {'prefill ms':>11} {'peak MiB':>16} "
        f"{'read MiB':>16}  plan"
    )
    for r in runs:
        ratio = f"{llama.ms_per_token / r.ms_per_token:.2f}x" if llama and r is not llama else ""
        pred = f"{r.predicted_ms:.0f}" if r.predicted_ms else ""
        peak = "/".join(f"{x:.0f}" for x in r.peak_mib)
        read = "/".join(f"{x:.0f}" for x in r.read_mib)
        prefill = f"{r.prefill_ms:.0f}" if r.prefill_ms is not None else ""
        print(
            f"{r.name:<18} {r.ms_per_token:>9.1f} {ratio:>9} {pred:>10} {prefill:>11} {peak:>16} {read:>16}  {r.plan}"
        )
    for r in runs:
        for node_id, n in r.extra.get("nodes", {}).items():
            print(
                f"  {node_id}: budget {n['budget_mib']:.0f} MiB, {n['pinned_layers']} layers pinned; prefetch read "
                f"{n['read_mib']:.0f} MiB in {n['read_ms']:.0f} ms, compute {n['compute_ms']:.0f} ms, "
                f"waited {n['wait_ms']:.0f} ms for reads"
            )
    for r in runs:
        hops = r.extra.get("hops", [])
        if hops:
            print("  per decode step, hop by hop: predicted ms (layers + send) / measured compute + relay ms")
        for h in hops:
            if h.get("compute_ms") is None:
                continue
            lo, hi = h["window"]
            pred = f"{h['predicted_ms']:.2f}" if h.get("predicted_ms") is not None else "?"
            print(
                f"    {h['node_id']} round {h['round']} [{lo},{hi}): predicted {pred}, "
                f"measured {h['compute_ms']:.2f} + {h['relay_ms']:.2f} over {h['measured_steps']} steps"
            )
    same = {tuple(r.token_ids) for r in runs}
    print(
        "greedy tokens identical across runs"
        if len(same) == 1
        else f"greedy tokens differ: {[r.token_ids[:8] for r in runs]}"
    )
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"[bench_scale took {time.time() - t0:.0f} s]", file=sys.stderr)
    sys.exit(code)
