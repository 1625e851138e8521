"""The host side of the mixed-architecture ring check of .ci/arm64/run: given the address of an
aarch64 primad (started by run.sh under emulation), start an x86 primad on loopback, run the tiny
model on the two as a ring in exact mode, and compare its greedy tokens with this device alone.

    python3 .ci/arm64/mixed_ring.py MODEL.gguf ARM_ADDRESS

Exact mode keeps activations and the KV cache in float32 and the kernels' float sums in a fixed
order, so a ring split across x86 and aarch64 gives the same greedy tokens as one device; q8 mode
quantizes prompt activations differently per architecture (x86's int8 GEMM, ARM's dequantize +
BLAS), so only exact mode is held to this. The tiny model's greedy tokens soon repeat one token, so
the last prompt token's logits are compared too, within the x86 tests' float32 bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests`

from tests.primad_proc import start_primad  # noqa: E402

PROMPT = "The capital of France is"
N_TOKENS = 8
F32_TOLERANCE = 1e-3  # tests/model/test_tiny_qwen.py's bound for float32 logits


def run(logits: Path, *args: str) -> dict:
    """`prima run --json` with `args`; the last prompt token's logits are saved to `logits`."""
    cmd = [sys.executable, "-m", "prima.cli.main", "run", *args, "-p", PROMPT, "-n", str(N_TOKENS)]
    cmd += ["--json", "--logits-out", str(logits)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main(model: Path, arm_address: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        x86 = start_primad("127.0.0.1", 0, model, out, "--exact", "--no-mdns", "--name", "x86")
        try:
            # Two of the four layers on each daemon, in the order --nodes names them.
            nodes = f"{x86.address},{arm_address}"
            ring = run(out / "ring.npy", "--nodes", nodes, "--windows", "2,2", "--exact", "-m", str(model))
        finally:
            x86.stop()
        alone = run(out / "alone.npy", "--local", "--exact", "-m", str(model))
        diff = float(np.abs(np.load(out / "ring.npy") - np.load(out / "alone.npy")).max())
    plan = {n["node_id"]: n["windows"] for n in ring["plan"]["nodes"]}
    print(f"ring x86 + aarch64 {plan}: {ring['token_ids']}")  # noqa: T201
    print(f"one device (x86): {alone['token_ids']}; max |logit difference| {diff:.2e}")  # noqa: T201
    if ring["token_ids"] != alone["token_ids"] or not diff <= F32_TOLERANCE:
        sys.exit(f"the mixed-architecture ring differs from one device (tolerance {F32_TOLERANCE:g})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2])
