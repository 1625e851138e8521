"""Does Halda's predicted time per token match the ring's? A local ring of 3 primad, one of them
with a --mem-budget below its share of the layers; each plan's predicted ms/token (cost model over
the daemons' own profiles, Profile RPC) against the measured decode ms/token (Generate RPC).

    python bench/bench_plan_vs_measured.py [--model smollm2-135m] [-n 32] [--budgets 30M,30M,12M]

Rows: the single engine in this process (node0's profile, no budget: how well the compute term
alone predicts), Halda's plan, and an even split over 3 rounds where the small-budget node must
stream its windows from disk every token (the cost model's disk term). Profiles are measured
afresh into a temporary cache. Aim: measured/predicted within 25%.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.planner import HaldaOptions
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, collect, generate, stream_text
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.plan import even_window_sizes
from prima.scheduler.cost_model import predict_ms_per_token
from prima.scheduler.profile_cache import CACHE_ENV
from prima.scheduler.profile_schema import ModelProfile

PROMPT = "The capital of France is"
N_CTX = 512
RUNS = 3


def decode_ms_per_token(ring: Ring, ids: list[int], n: int) -> tuple[float, float]:
    """(median, best) over RUNS of (time from the first token to the last) / (tokens - 1), after a warm-up."""
    samples = []
    for run in range(RUNS + 1):
        request = GenerateRequest(tuple(ids), 4 if run == 0 else n, SamplerConfig(), n_ctx=N_CTX)
        result = collect(stream_text(ring.generate(request), ids))
        if run:
            samples.append(result.timings.generate_ms / max(result.timings.generated_tokens - 1, 1))
    return statistics.median(samples), min(samples)


def single_engine_ms_per_token(model: str, ids: list[int], n: int) -> tuple[float, float]:
    """The same measure on a LocalEngine in this process, one thread like each daemon."""
    engine = LocalEngine(load_model(model, threads=1).model, n_ctx=N_CTX)
    samples = []
    for run in range(RUNS + 1):
        result = generate(engine, ids, max_tokens=4 if run == 0 else n, sampler=SamplerConfig())
        if run:
            samples.append(result.timings.generate_ms / max(result.timings.generated_tokens - 1, 1))
    return statistics.median(samples), min(samples)


def report(name: str, ring: Ring | None, predicted: float, measured: tuple[float, float]) -> None:
    """One row: the plan, predicted ms/token, measured median (and best run), their ratio."""
    median, best = measured
    windows = "node0:all"
    if ring is not None:
        windows = "  ".join(
            f"{n.node_id}:{'+'.join(str(w.n_layers) for w in n.windows)}" for n in ring.plan.nodes
        )
    print(
        f"{name:<15} {windows:<36} predicted {predicted:6.2f} ms/token  measured {median:6.2f} "
        f"(best run {best:6.2f})  measured/predicted {median / predicted:4.2f} (best {best / predicted:4.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("-n", type=int, default=32, help="tokens per measured run")
    parser.add_argument("--budgets", default="30M,30M,16M", help="--mem-budget of node0,node1,node2")
    args = parser.parse_args()
    loaded = load_model(args.model, layers=range(0))
    ids = loaded.tokenizer.encode(PROMPT)
    model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=N_CTX)
    budgets = args.budgets.split(",")
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache  # the daemons inherit it: fresh profiles for this run
        with LocalRing.start(3, loaded.path, mem_budgets=budgets, log_dir=Path(cache) / "logs") as local:
            print(
                f"{args.model}: {model.n_layers} layers of {model.layer_bytes / 2**20:.1f} MiB; budgets {budgets}"
            )
            ring = Ring.connect(local.addresses, halda=HaldaOptions(model))
            try:
                devices = ring.devices
                for d in devices:
                    flops = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(d.cpu_flops.items()))
                    print(
                        f"  {d.node_id}: GFLOP/s {flops}; disk {d.disk_read_bytes_per_s / 1e9:.2f} GB/s; "
                        f"RAM for layers {d.ram_available_bytes / 2**20:.0f} MiB; hop {d.net_latency_ms:.2f} ms"
                    )
                alone = dataclasses.replace(devices[0], ram_available_bytes=64 << 30)
                predicted = predict_ms_per_token([alone], model, 1, [model.n_layers])
                report("single engine", None, predicted, single_engine_ms_per_token(args.model, ids, args.n))
                assert ring.plan.predicted_ms_per_token is not None
                measured = decode_ms_per_token(ring, ids, args.n)
                report("halda", ring, ring.plan.predicted_ms_per_token, measured)
                even = even_window_sizes(3, model.n_layers, 3)
                ring.load(window_sizes=even, rounds=3)
                predicted = predict_ms_per_token(devices, model, 3, even)
                report("even, 3 rounds", ring, predicted, decode_ms_per_token(ring, ids, args.n))
                for s in ring.info():
                    if s.residency and s.residency.releases:
                        r = s.residency
                        print(
                            f"  {s.node_id} streamed: {r.releases} window releases, peak "
                            f"{r.peak_resident_bytes / 2**20:.1f} of {r.owned_bytes / 2**20:.1f} MiB resident"
                        )
            finally:
                ring.close()


if __name__ == "__main__":
    main()
