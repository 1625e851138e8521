"""Instructions executed per decode-sized matvec on aarch64, counted under qemu-user: a speed
proxy where no ARM board is at hand (counts repeat exactly run to run for a named CPU model;
emulated time means nothing).

    python bench/bench_arm_insn.py [--cpu cortex-a76 --cpu cortex-a53] [--formats Q4_1,Q8_0]
                                   [--modes q8,exact] [--reps 5] [--json OUT.json]

Runs on an x86-64 Linux host with the arm64 userland of .ci/arm64/run (build it first, as root;
$ARM64_ROOT if elsewhere) and this checkout's prima, which qemu reads from the host. Needs apt-get
and gcc: Debian's dynamic qemu-user (whose qemu-aarch64 loads plugins; the static one cannot) is
fetched with `apt-get download` into the tools directory, and bench/arm_insn/insn_count.c is
compiled there. Kernels compile for each CPU model (NUMBA_CPU_NAME) on first use, minutes under
emulation; the cache is kept in the tools directory.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
DEFAULT_ROOT = Path(os.environ.get("ARM64_ROOT", "/var/cache/prima-ci/arm64"))
# Debian packages of the dynamic qemu-user and the libraries it links that a host may lack.
QEMU_DEBS = ("qemu-user", "libcapstone4", "liburing2")


def qemu_tools(tools: Path) -> tuple[Path, Path, dict[str, str]]:
    """(qemu-aarch64 with plugin support, the counting plugin, the environment qemu needs),
    fetched and built into `tools` once."""
    unpacked = tools / "qemu"
    qemu = unpacked / "usr" / "bin" / "qemu-aarch64"
    libs = unpacked / "usr" / "lib" / "x86_64-linux-gnu"
    if not qemu.exists():
        with tempfile.TemporaryDirectory() as d:
            subprocess.run(["apt-get", "download", "-qq", *QEMU_DEBS], cwd=d, check=True)
            for deb in Path(d).glob("*.deb"):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
    plugin = tools / "libinsn_count.so"
    source = HERE / "arm_insn" / "insn_count.c"
    if not plugin.exists() or plugin.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(
            [
                "gcc",
                "-O2",
                "-Wall",
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-o",
                str(plugin),
                str(source),
            ],
            check=True,
        )
    return qemu, plugin, {"LD_LIBRARY_PATH": str(libs)}


def count(
    root: Path, tools: Path, cpu: str, cases: list[str], reps: int
) -> tuple[str, dict[str, dict[str, float]]]:
    """The probe's kernel paths line, and per case ("Q4_1:q8") the per-call counts of each kind."""
    qemu, plugin, qemu_env = qemu_tools(tools)
    out = tools / f"counts-{cpu}.txt"
    out.unlink(missing_ok=True)
    guest_env = {
        "PYTHONPATH": f"{CHECKOUT}:{root}/opt/site",
        "PRIMA_CACHE": str(tools / f"prima-cache-{cpu}"),
        "NUMBA_CPU_NAME": cpu,
        "NUMBA_NUM_THREADS": "1",  # the plugin's counters are exact with one guest thread
        "PYTHONHASHSEED": "0",
        "HOME": "/root",
        "LANG": "C.UTF-8",
    }
    cmd = [
        str(qemu), "-L", str(root), "-cpu", cpu, "-U", "LD_LIBRARY_PATH",
        "-plugin", f"{plugin},out={out}",
        f"{root}/usr/bin/python3.11", "-W", "ignore", str(HERE / "arm_insn" / "probe.py"), str(reps), *cases,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env={**guest_env, **qemu_env}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"the probe failed on {cpu}:\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    paths = next(line for line in lines if line.startswith("paths "))
    windows = [line.split()[1:] for line in lines if line.startswith("window ")]
    counts = [line.split() for line in out.read_text().splitlines()]
    kinds = 4  # insn_count.c's N_KINDS lines per window
    results = {}
    for i, (name, mode) in enumerate(windows):
        block = counts[i * kinds : (i + 1) * kinds]
        results[f"{name}:{mode}"] = {kind: int(n) / reps for kind, n in block}
    return paths, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="append", help="qemu CPU model, also numba's target (repeatable)")
    ap.add_argument("--formats", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--modes", default="q8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the arm64 userland of .ci/arm64/run")
    ap.add_argument("--tools", type=Path, default=Path("/var/cache/prima-ci/arm64-insn"))
    ap.add_argument("--json", type=Path, help="also write the counts here")
    args = ap.parse_args()
    if not (args.root / "usr" / "bin" / "python3.11").exists():
        sys.exit(f"no arm64 userland at {args.root}: run .ci/arm64/run as root first (or pass --root)")
    args.tools.mkdir(parents=True, exist_ok=True)
    cases = [f"{f}:{m}" for f in args.formats.split(",") for m in args.modes.split(",")]
    report = {}
    for cpu in args.cpu or ["cortex-a76"]:
        paths, results = count(args.root, args.tools, cpu, cases, args.reps)
        print(f"qemu -cpu {cpu}, NUMBA_CPU_NAME={cpu}: {paths.removeprefix('paths ')}")
        print(f"  {'format':6s} {'mode':5s} {'insns/call':>11s} {'sdot':>7s} {'udot':>7s} {'smull..':>8s}")
        for case, c in results.items():
            name, mode = case.split(":")
            print(
                f"  {name:6s} {mode:5s} {c['insns']:11.0f} {c['sdot']:7.0f} {c['udot']:7.0f} {c['widening_mul']:8.0f}"
            )
        report[cpu] = {"paths": paths, "counts": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
