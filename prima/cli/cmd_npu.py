"""`prima npu compile`: export a model's windows to ONNX and compile them with CANN's ATC for the
Ascend NPU (the acl backend), ahead of a plan; `--dry-run` prints the ATC command lines only.
`prima npu doctor`: the first command on a new board; its output is what a bug report needs."""

from __future__ import annotations

import argparse
import shlex

from prima.cli.arg_types import layer_window, positive_int
from prima.errors import InputError
from prima.model.files import open_model
from prima.model.registry import DEFAULT_MODEL

DEFAULT_CTX = 512  # as prima.backends.acl.backend.DEFAULT_CTX (not imported: onnx is optional)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("npu", help="compile a model's windows for an Ascend NPU (CANN ATC)")
    sub = parser.add_subparsers(dest="npu_command", metavar="ACTION", required=True)
    comp = sub.add_parser("compile", help="export windows to ONNX and compile them with ATC (cached)")
    comp.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    comp.add_argument(
        "--window",
        action="append",
        default=[],
        metavar="START-END",
        help="layers [START, END) to compile as one window (repeatable; default: the whole model)",
    )
    comp.add_argument(
        "--npu-ctx",
        "--ctx",
        dest="ctx",
        type=positive_int,
        default=DEFAULT_CTX,
        metavar="N",
        help=f"KV cache slots per window, the longest session it serves (default {DEFAULT_CTX}); "
        "give primad the same --npu-ctx",
    )
    comp.add_argument(
        "--gears", default="1,2,4,8", help="tokens per call the model accepts (default 1,2,4,8)"
    )
    comp.add_argument("--soc", default="Ascend310B1", help="ATC --soc_version (default Ascend310B1)")
    comp.add_argument(
        "--host-env",
        default=None,
        metavar="OS/CPU",
        help="compile for another machine that will run the model, e.g. linux/aarch64 for a board "
        "when compiling on an x86 laptop (ATC's --host_env_os and --host_env_cpu; default: this one)",
    )
    comp.add_argument("--dry-run", action="store_true", help="print the ATC command lines, run nothing")
    comp.set_defaults(func=run_compile)
    doc = sub.add_parser(
        "doctor",
        help="check the NPU toolchain, compile, load and run layer 0 against the CPU (paste the output "
        "into bug reports)",
    )
    doc.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    doc.add_argument(
        "--npu-ctx",
        dest="ctx",
        type=positive_int,
        default=DEFAULT_CTX,
        metavar="N",
        help=f"KV slots of the window (default {DEFAULT_CTX}, primad's: its profile window is then cached)",
    )
    doc.set_defaults(func=run_doctor)


def run_compile(args: argparse.Namespace) -> int:
    from prima.backends.acl import atc

    weights = open_model(args.model).weights
    n = weights.config.n_layers
    windows = [layer_window(w, n) for w in args.window] or [range(n)]
    try:
        gears = tuple(int(g) for g in args.gears.split(","))
    except ValueError:
        raise InputError(f"--gears {args.gears!r}: expected numbers separated by commas") from None
    host_env = None
    if args.host_env is not None:
        host_os, _, cpu = args.host_env.partition("/")
        if not host_os or not cpu:
            raise InputError(f"--host-env {args.host_env!r}: expected OS/CPU, e.g. linux/aarch64")
        host_env = atc.HostEnv(host_os, cpu)
    fingerprint = weights.gguf.fingerprint()
    for layers in windows:
        art = atc.artifacts(weights, fingerprint, layers, args.ctx, gears, args.soc, host_env=host_env)
        if args.dry_run:
            print(f"# layers {layers.start}-{layers.stop - 1} -> {art.om}")
            print(shlex.join(art.job.argv()))
            continue
        om = atc.compile_window(weights, art, layers, args.ctx, progress=print)
        print(f"layers {layers.start}-{layers.stop - 1}: {om}")
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    """Print every finding, the toolchain's first; exit 1 if any is not fine."""
    from prima.backends.acl import AclBackend, doctor

    weights = open_model(args.model).weights
    findings = list(doctor.toolchain())
    if all(f.ok for f in findings if f.check in doctor.NEEDED_FOR_A_WINDOW):
        findings += doctor.window_report(weights, args.ctx, AclBackend)
    for f in findings:
        print(f"{'ok  ' if f.ok else 'FAIL'} {f.check}: {f.found}")
    print("nothing above is known to be right on a device until someone runs it there (docs/orangepi.md)")
    return 0 if all(f.ok for f in findings) else 1
