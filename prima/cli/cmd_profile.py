"""`prima profile`: measure this device and print its DeviceProfile (a table, or JSON for a
devices file that `prima plan --devices` reads)."""

from __future__ import annotations

import argparse
import json
import math

from prima.cli.progress import StepBar
from prima.model.registry import resolve_model
from prima.scheduler.device_probe import profile_device
from prima.scheduler.kernel_bench import kernel_flops
from prima.scheduler.profile_schema import DeviceProfile

_GIB = float(1 << 30)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="measure this device's memory, disk and compute")
    parser.add_argument(
        "-m",
        "--model",
        help="GGUF path or known model name: read its file for the disk speed, time its formats",
    )
    parser.add_argument("--node-id", help="name of this device in plans (default: host name)")
    parser.add_argument("--address", default="", help="host:port where this device's primad listens")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model_path = resolve_model(args.model, download=False) if args.model else None
    with StepBar("profiling") as bar:
        dev = profile_device(
            args.node_id, args.address, model_path=model_path, kernel_bench=kernel_flops, on_progress=bar
        )
    if args.json:
        print(json.dumps(dev.to_dict(), indent=2))
        return 0
    for label, value in _describe(dev):
        print(f"{label:<22}{value}")
    return 0


def _describe(dev: DeviceProfile) -> list[tuple[str, str]]:
    rows = [
        ("node", f"{dev.node_id} {dev.address}".strip()),
        ("os", dev.os),
        ("RAM usable/total", f"{dev.ram_available_bytes / _GIB:.2f} / {dev.ram_total_bytes / _GIB:.2f} GiB"),
        ("swap free/total", f"{dev.swap_free_bytes / _GIB:.2f} / {dev.swap_total_bytes / _GIB:.2f} GiB"),
        ("memory bandwidth", f"{dev.mem_bandwidth_bytes_per_s / 1e9:.1f} GB/s"),
        ("disk read (cold)", f"{dev.disk_read_bytes_per_s / 1e9:.2f} GB/s"),
    ]
    rows += [(f"GEMV {fmt}", f"{flops / 1e9:.1f} GFLOP/s") for fmt, flops in sorted(dev.cpu_flops.items())]
    if dev.accelerator is not None:
        a = dev.accelerator
        rows.append(("accelerator", f"{a.kind}, {a.memory_available_bytes / _GIB:.2f} GiB"))
    if dev.net_latency_ms or math.isfinite(dev.net_bandwidth_bytes_per_s):
        rows.append(
            ("network", f"{dev.net_latency_ms:.1f} ms, {dev.net_bandwidth_bytes_per_s * 8 / 1e6:.0f} Mbit/s")
        )
    return rows
