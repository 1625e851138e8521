"""Detection, re-plan and replay times of a failover, on local rings of primad (loopback only).

    python bench/bench_failover.py [--model smollm2-135m] [--nodes 3] [-n 128] [--at 40]

For each failure kind (SIGKILL of a follower, SIGKILL of the head, SIGSTOP of a follower) a fresh
ring generates greedily, the node fails once token --at has arrived, and the ring recovers. Prints
each recovery's times and whether the tokens equal the failure-free run's."""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
from collections.abc import Callable

from prima.coordinator.failover import FailoverRing, Recovery, RingSpec
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, GenerationDone
from prima.engine.prompt import prompt_ids
from prima.forward.loader import load_model

PROMPT = "The capital of France is"
KINDS: dict[str, Callable[[LocalRing, int], None]] = {
    "sigkill follower": lambda ring, n: ring.kill(n - 1),
    "sigkill head": lambda ring, n: ring.kill(0),
    "sigstop follower": lambda ring, n: ring.pause(n - 1),
}


def run(
    model: str, n_nodes: int, request: GenerateRequest, fail: Callable[[LocalRing], None] | None, at: int
) -> tuple[list[int], list[Recovery]]:
    with LocalRing.start(n_nodes, model, threads=1, extra_args=("--exact",)) as local:
        ring = FailoverRing(Ring.connect(local.addresses), RingSpec(tuple(local.addresses)))
        try:
            tokens = []
            for event in ring.generate(request):
                if isinstance(event, GenerationDone):
                    break
                tokens.append(event)
                if fail is not None and len(tokens) == at:
                    fail(local)
            return tokens, ring.recoveries
        finally:
            ring.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--at", type=int, default=40)
    args = ap.parse_args()
    ids = prompt_ids(load_model(args.model, layers=range(0)).tokenizer, PROMPT)
    request = GenerateRequest(tuple(ids), args.n, n_ctx=512)
    expected, _ = run(args.model, args.nodes, request, None, args.at)
    print(f"{args.model}, {args.nodes} nodes, {args.n} tokens, failure after token {args.at}")
    for kind, fail in KINDS.items():
        tokens, recoveries = run(args.model, args.nodes, request, lambda r, f=fail: f(r, args.nodes), args.at)
        for r in recoveries:
            print(
                f"  {kind:17s} detect {r.detect_ms:7.0f} ms  re-plan {r.replan_ms:6.0f} ms  "
                f"replay {r.replay_ms:6.0f} ms ({r.at_token} tokens)  ring {' -> '.join(r.nodes)}  "
                f"tokens equal: {tokens == expected}"
            )


if __name__ == "__main__":
    main()
