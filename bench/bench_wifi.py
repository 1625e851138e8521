"""A ring over an emulated home Wi-Fi: Halda's predicted ms/token against the measured one, and
how many devices Halda uses, as link latency grows.

    python bench/bench_wifi.py [--model smollm2-135m] [-n 32]

Three primad on this machine, each behind a link shaper (prima.net.link_shaper: one-way delay,
jitter, a bandwidth cap) on an address of its own in 127.0.0.0/8, for both its gRPC port and its
activation link. Every row is planned afresh: the daemons measure the shaped link to their
successor (Profile RPC), Halda plans over those profiles, and the plan's decode ms/token is
measured (Generate RPC, median of runs). A second row per link forces all three devices, one
round, so the network terms are exercised even where Halda would rather not use them. Links: loopback,
then the seeds' Wi-Fi (3-7 ms, 320-610 Mbit/s). Aim: measured/predicted within 15%; Halda
keeps fewer hops when latency dominates.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import contextlib
import os
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench_plan_vs_measured import N_CTX, decode_ms_per_token  # bench/ is on sys.path when run

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.planner import HaldaOptions
from prima.coordinator.ring import Ring
from prima.forward.loader import load_model
from prima.net.link_shaper import LinkShape, shaped_daemons
from prima.plan import even_window_sizes
from prima.scheduler.cost_model import predict_ms_per_token
from prima.scheduler.profile_cache import CACHE_ENV
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile

PROMPT = "The capital of France is"
NODES = 3
LINKS: list[tuple[str, LinkShape | None]] = [
    ("loopback", None),
    ("wifi 3 ms", LinkShape(delay_ms=3.0, jitter_ms=0.5, mbit_per_s=610.0)),
    ("wifi 5 ms", LinkShape(delay_ms=5.0, jitter_ms=1.0, mbit_per_s=450.0)),
    ("wifi 7 ms", LinkShape(delay_ms=7.0, jitter_ms=1.5, mbit_per_s=320.0)),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def row(
    link: str, plan_name: str, ring: Ring, devices: Sequence[DeviceProfile], predicted: float, measured: float
) -> None:
    windows = "  ".join(
        f"{n.node_id}:{'+'.join(str(w.n_layers) for w in n.windows)}" for n in ring.plan.nodes
    )
    hops = "  ".join(f"{d.node_id} {d.net_latency_ms:.2f} ms" for d in devices)
    print(
        f"{link:<10} {plan_name:<7} {windows:<30} predicted {predicted:6.2f}  measured {measured:6.2f} "
        f"ms/token  measured/predicted {measured / predicted:4.2f}   links: {hops}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("-n", type=int, default=32, help="tokens per measured run")
    parser.add_argument(
        "--budgets",
        default="",
        help="--mem-budget of each daemon, comma-separated (e.g. 40M,40M,40M: no daemon holds the "
        "whole model, so the ring needs several); default: none",
    )
    args = parser.parse_args()
    loaded = load_model(args.model, layers=range(0))
    ids = loaded.tokenizer.encode(PROMPT)
    model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=N_CTX)
    link_ports = [free_port() for _ in range(NODES)]
    node_args = [["--link-port", str(p)] for p in link_ports]
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache  # the daemons inherit it: fresh profiles for this run
        budgets = args.budgets.split(",") if args.budgets else None
        logs = Path(cache) / "logs"
        with LocalRing.start(
            NODES, loaded.path, mem_budgets=budgets, node_args=node_args, log_dir=logs
        ) as local:
            print(
                f"{args.model}: {model.n_layers} layers of {model.layer_bytes / 2**20:.1f} MiB; {NODES} daemons "
                f"on {os.cpu_count()} cores; budgets {budgets or 'none'}"
            )
            for name, shape in LINKS:
                links = (
                    shaped_daemons(local.addresses, link_ports, shape)
                    if shape is not None
                    else contextlib.nullcontext((list(local.addresses), []))
                )
                with links as (addresses, _):
                    ring = Ring.connect(addresses, halda=HaldaOptions(model, refresh=True))
                    try:
                        assert ring.plan.predicted_ms_per_token is not None
                        devices = list(ring.devices)
                        measured = decode_ms_per_token(ring, ids, args.n)[0]
                        row(name, "halda", ring, devices, ring.plan.predicted_ms_per_token, measured)
                    finally:
                        ring.close()
                    even = even_window_sizes(len(devices), model.n_layers, 1)
                    ring = Ring.connect(addresses, window_sizes=even, rounds=1)
                    try:
                        predicted = predict_ms_per_token(devices, model, 1, even)
                        row(
                            name, "all 3", ring, devices, predicted, decode_ms_per_token(ring, ids, args.n)[0]
                        )
                    finally:
                        ring.close()


if __name__ == "__main__":
    main()
