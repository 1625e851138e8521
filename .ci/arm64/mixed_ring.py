"""The host side of the mixed-architecture ring check of .ci/arm64/run: given the address of an
aarch64 primad (started by run.sh under emulation), start an x86 primad on loopback, run the tiny
model on the two as a ring in exact mode, and compare its greedy tokens with this device alone.

    python3 .ci/arm64/mixed_ring.py MODEL.gguf ARM_ADDRESS

Exact mode keeps activations and the KV cache in float32 and the kernels' float sums in a fixed
order, so a ring split across x86 and aarch64 gives the same greedy tokens as one device; q8 mode
quantizes prompt activations differently per architecture (x86's int8 GEMM, ARM's dequantize +
BLAS), so only exact mode is held to this.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests`

from tests.primad_proc import start_primad  # noqa: E402

PROMPT = "The capital of France is"
N_TOKENS = 8


def run(*args: str) -> dict:
    cmd = [sys.executable, "-m", "prima.cli.main", "run", *args, "-p", PROMPT, "-n", str(N_TOKENS), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main(model: Path, arm_address: str) -> None:
    with tempfile.TemporaryDirectory() as logs:
        x86 = start_primad("127.0.0.1", 0, model, Path(logs), "--exact", "--no-mdns", "--name", "x86")
        try:
            # Two layers on each: the x86 daemon computes [0, 2), the aarch64 one [2, 4) and the head.
            ring = run(
                "--nodes", f"{x86.address},{arm_address}", "--windows", "2,2", "--exact", "-m", str(model)
            )
        finally:
            x86.stop()
    alone = run("--local", "--exact", "-m", str(model))
    print(f"ring x86 + aarch64: {ring['token_ids']}  plan {[n['windows'] for n in ring['plan']['nodes']]}")  # noqa: T201
    print(f"one device (x86):   {alone['token_ids']}")  # noqa: T201
    if ring["token_ids"] != alone["token_ids"]:
        sys.exit("the mixed-architecture ring's tokens differ from one device's")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2])
