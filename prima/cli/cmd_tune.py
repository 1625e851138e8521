"""`prima tune`: time a decode step here with 1 and all cores (and the big cores alone, where
the CPU has two kinds), each way idle workers can wait, and keep the fastest for this model (the
choice `run`, `chat`, `serve` and `primad` make on their own the first time; run this again
after the machine's load or hardware changed)."""

from __future__ import annotations

import argparse
import json

from prima.engine.thread_tuning import (
    ThreadSetting,
    big_cores,
    cpu_capacities,
    tune,
    usable_cores,
    usable_cpus,
)
from prima.engine.warmup import ensure_compiled
from prima.model.gguf_file import GGUFFile
from prima.model.registry import DEFAULT_MODEL, resolve_model

from .progress import stage


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tune", help="choose compute threads by timing a decode step here")
    parser.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    ensure_compiled(path, on_stage=stage)
    with GGUFFile(path) as gguf:
        fingerprint = gguf.fingerprint()
    cores = usable_cores()
    big = big_cores(cpu_capacities(), usable_cpus())
    also = f" and on the {len(big)} big cores alone" if big else ""
    stage(f"timing decode steps of {path.name} with 1 and {cores} threads{also}")
    chosen, measured, _ = tune(path, fingerprint, cores=cores, refresh=True)
    if args.json:
        print(
            json.dumps(
                {
                    "cores": cores,
                    "chosen": _setting(chosen),
                    "measured": [{**_setting(m.setting), "ms_per_step": m.ms_per_step} for m in measured],
                }
            )
        )
        return 0
    fastest = min(m.ms_per_step for m in measured)
    print(f"{'setting':<44} {'ms/step':>8} {'vs best':>8}")
    for m in measured:
        mark = "  <- chosen" if m.setting == chosen else ""
        print(f"{m.setting.describe():<44} {m.ms_per_step:8.2f} {m.ms_per_step / fastest:7.2f}x{mark}")
    return 0


def _setting(s: ThreadSetting) -> dict[str, object]:
    return {"threads": s.threads, "wait": s.wait, "cpus": list(s.cpus)}
