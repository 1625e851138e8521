"""Halda scheduling time for rings of 4, 8, 16 and 32 devices (the original reports 10-12 ms).

Run: python bench/bench_halda.py [--repeat N]. Prints the median CPU time (time.process_time, so
other load on a shared machine counts less than in wall time) of `halda.solve` per cluster size
for a Llama-3-70B-shaped model (80 layers: 10 values of k) and a 32-layer 8B one. The first call
compiles the search (numba, cached on disk), so one untimed solve runs first.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import statistics
import time

import numpy as np

from prima.scheduler import halda
from prima.scheduler.profile_schema import AcceleratorProfile, DeviceProfile, ModelProfile

GiB = 1 << 30


def model_profile(n_layers: int, layer_gib: float) -> ModelProfile:
    layer_bytes = int(layer_gib * GiB)
    return ModelProfile(
        name=f"bench-{n_layers}",
        arch="llama",
        n_layers=n_layers,
        layer_bytes=layer_bytes,
        layer_flops={"Q4_K": 2.0 * layer_bytes * 8 / 4.5},
        kv_bytes_per_token_per_layer=8 * 128 * 2 * 4,
        input_bytes=layer_bytes,
        output_bytes=layer_bytes,
        output_flops={"Q6_K": 2.0 * layer_bytes * 8 / 6.5},
        activation_bytes=8192 * 4,
        ctx_tokens=4096,
    )


def home_cluster(n_devices: int, seed: int) -> list[DeviceProfile]:
    """Laptops, phones and boards: 1.5-16 GiB free, 0.5-3.5 GB/s disks, some with a GPU/NPU."""
    rng = np.random.default_rng(seed)
    devices = []
    for i in range(n_devices):
        accel = None
        if rng.random() < 0.3:
            accel = AcceleratorProfile(
                kind="cuda",
                memory_available_bytes=int(rng.uniform(2, 10) * GiB),
                flops={"F32": float(rng.uniform(1, 10)) * 1e12},
                mem_bandwidth_bytes_per_s=float(rng.uniform(200, 600)) * 1e9,
                shares_ram=bool(rng.random() < 0.3),
            )
        devices.append(
            DeviceProfile(
                node_id=f"dev{i}",
                address=f"10.0.0.{i + 2}:7070",
                ram_total_bytes=32 * GiB,
                ram_available_bytes=int(rng.uniform(1.5, 16) * GiB),
                disk_read_bytes_per_s=float(rng.uniform(0.5, 3.5)) * 1e9,
                mem_bandwidth_bytes_per_s=float(rng.uniform(10, 60)) * 1e9,
                cpu_flops={"F32": float(rng.uniform(20, 300)) * 1e9},
                accelerator=accel,
                net_latency_ms=float(rng.uniform(2, 8)),
                net_bandwidth_bytes_per_s=float(rng.uniform(300, 600)) * 1e6 / 8,
            )
        )
    return devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    models = [model_profile(80, 0.5), model_profile(32, 0.14)]
    halda.solve(home_cluster(4, seed=0), models[1])  # compile (or load) the search first
    print(f"{'model':>10} {'devices':>7} {'median ms':>10} {'min ms':>8}  plan")
    for model in models:
        for n in (4, 8, 16, 32):
            devices = home_cluster(n, seed=n)
            timings = []
            for _ in range(args.repeat):
                t0 = time.process_time()
                plan = halda.solve(devices, model)
                timings.append((time.process_time() - t0) * 1e3)
            summary = f"k={plan.rounds} ring={len(plan.nodes)} {plan.predicted_ms_per_token:.0f} ms/token"
            print(
                f"{model.name:>10} {n:>7} {statistics.median(timings):>10.1f} {min(timings):>8.1f}  {summary}"
            )


if __name__ == "__main__":
    main()
