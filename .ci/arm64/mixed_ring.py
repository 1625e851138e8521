"""The host side of the mixed-architecture ring checks of .ci/arm64/run: given SmolLM2 and the
address of an aarch64 primad serving it (started by run under emulation), start x86 primad on
loopback, run x86 + aarch64 as a ring in exact mode, and compare its greedy tokens and the last
prompt token's logits with this device alone; then fail over onto the other architecture: a ring
of two x86 daemons and the aarch64 one loses an x86 daemon mid-generation (SIGKILL), re-plans
over x86 + aarch64, and must still give this device's tokens (docs/devices.md).

    python3 .ci/arm64/mixed_ring.py MODEL.gguf ARM_ADDRESS

Exact mode keeps activations and the KV cache in float32 and the kernels' float sums in a fixed
order, so a ring split across x86 and aarch64 gives the same greedy tokens as one device; q8 mode
quantizes prompt activations differently per architecture (x86's int8 GEMM, ARM's dequantize +
BLAS), so only exact mode is held to this. The last prompt token's logits are compared too, within
the x86 tests' float32 bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests`

from prima.coordinator.failover import FailoverRing, RingSpec
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, sample_tokens
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from tests.primad_proc import start_primad

PROMPT = "The capital of France is"
N_TOKENS = 8
FAILOVER_TOKENS = 24
KILL_AFTER = 3  # tokens streamed before the x86 follower is killed
N_CTX = 128
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
            # Half the layers on each daemon, in the order --nodes names them.
            nodes = f"{x86.address},{arm_address}"
            ring = run(out / "ring.npy", "--nodes", nodes, "--windows", "15,15", "--exact", "-m", str(model))
        finally:
            x86.stop()
        alone = run(out / "alone.npy", "--local", "--exact", "-m", str(model))
        diff = float(np.abs(np.load(out / "ring.npy") - np.load(out / "alone.npy")).max())
        failover_tokens(model, arm_address, out)
    plan = {n["node_id"]: n["windows"] for n in ring["plan"]["nodes"]}
    print(f"ring x86 + aarch64 {plan}: {ring['token_ids']}")  # noqa: T201
    print(f"one device (x86): {alone['token_ids']}; max |logit difference| {diff:.2e}")  # noqa: T201
    if ring["token_ids"] != alone["token_ids"] or not diff <= F32_TOLERANCE:
        sys.exit(f"the mixed-architecture ring differs from one device (tolerance {F32_TOLERANCE:g})")


def failover_tokens(model: Path, arm_address: str, out: Path) -> None:
    """x86, x86, aarch64 (exact); the second x86 daemon killed after KILL_AFTER tokens; the
    recovered ring's greedy tokens against this device's."""
    loaded = load_model(model, mode="exact")
    ids = prompt_ids(loaded.tokenizer, PROMPT)
    request = GenerateRequest(tuple(ids), FAILOVER_TOKENS, SamplerConfig(), n_ctx=N_CTX)
    engine = LocalEngine(loaded.model, n_ctx=N_CTX)
    alone = [e for e in sample_tokens(engine, request) if isinstance(e, int)]
    head = start_primad("127.0.0.1", 0, model, out, "--exact", "--no-mdns", "--name", "x86-head")
    victim = start_primad("127.0.0.1", 0, model, out, "--exact", "--no-mdns", "--name", "x86-victim")
    try:
        addresses = (head.address, victim.address, arm_address)
        ring = FailoverRing(Ring.connect(addresses, window_sizes=[10, 10, 10]), RingSpec(addresses))
        got: list[int] = []
        try:
            for event in ring.generate(request):
                if isinstance(event, int):
                    got.append(event)
                    if len(got) == KILL_AFTER:
                        victim.proc.kill()
            plan = {n.node_id: [(w.start, w.end) for w in n.windows] for n in ring.plan.nodes}
        finally:
            ring.close()
    finally:
        victim.stop()
        head.stop()
    print(f"failover onto x86 + aarch64 (now {plan}): {got}")  # noqa: T201
    print(f"one device (x86): {alone}")  # noqa: T201
    if "x86-victim" in plan or "arm64" not in plan:
        sys.exit(f"the ring after the failure is not x86 + aarch64: {plan}")
    if len(set(alone)) < 4:
        sys.exit(f"the reference tokens are too uniform to tell rings apart: {alone}")
    if got != alone:
        sys.exit("failing over onto another architecture changed the tokens (exact mode)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2])
