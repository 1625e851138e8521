"""`prima warmup`: fetch a model into the cache and compile the kernels for this CPU, then exit.

This is what every first run and every daemon's first start does before anything else. Done
once ahead (deploy/docker-compose.yml's init service, deploy/prima-warmup.service), the compile
runs within its own memory limit, not inside a small device's, and the model is fetched once for
all the daemons that share the cache."""

from __future__ import annotations

import argparse

from prima.engine.warmup import ensure_compiled
from prima.kernels import compile_cache
from prima.model.registry import DEFAULT_MODEL, resolve_model

from .progress import StepBar, stage


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "warmup",
        help="fetch a model and compile the kernels for this CPU, then exit",
        description=__doc__,
    )
    parser.add_argument(
        "-m",
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name (fetched if absent) or GGUF path whose forward pass compiles the kernels "
        f"(default {DEFAULT_MODEL})",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    with StepBar("compiling") as bar:
        compiled = ensure_compiled(path, on_stage=stage, on_progress=bar)
    if not compile_cache.have_numba():
        stage("numba is not installed: nothing to compile (prima runs its slower numpy kernels)")
    elif not compiled:
        stage(f"kernels already compiled for this CPU, in {compile_cache.cache_dir()}")
    print(path)
    return 0
