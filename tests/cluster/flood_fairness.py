"""A generation beside a member's flood of long micro-batches on another session, against the
same generation alone: its tokens and both times. Used by test_flood_fairness.py;
`python -m tests.cluster.flood_fairness --tokens 2048` measures it with batches of that many
tokens (the daemon started with --max-batch to match)."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from prima.coordinator.local_ring import LocalRing
from prima.net import codec
from prima.net.codec import Activation
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.plan import plan_from_window_sizes
from tests.cluster.generate_rpc import generate_tokens

D_MODEL = 576  # smollm2-135m
N_LAYERS = 30
CALL_S = 120
FLOOD_STREAMS = 200  # at most this many Relay streams (each ends when the queue is full)
FLOOD_S = 300.0  # and at most this long


@dataclass
class FloodResult:
    solo_s: float
    beside_s: float
    refused: int  # flood streams ended by the full queue: the flood kept the daemon busy


def start_daemon(model: str, *args: str) -> tuple[LocalRing, grpc.Channel, pb_grpc.NodeStub]:
    """One plaintext primad on 127.0.0.1 holding every layer, its plan loaded."""
    ring = LocalRing.start(1, model, threads=1, extra_args=("--exact", *args), plaintext=True)
    channel = grpc.insecure_channel(ring.addresses[0], options=[("grpc.max_send_message_length", -1)])
    stub = pb_grpc.NodeStub(channel)
    plan = plan_from_window_sizes([("node0", ring.addresses[0])], [N_LAYERS], 1, N_LAYERS, epoch=1)
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="node0"), timeout=CALL_S)
    return ring, channel, stub


def generate(stub: pb_grpc.NodeStub, max_tokens: int = 8) -> list[int]:
    return generate_tokens(stub, max_tokens=max_tokens, timeout_s=CALL_S * 4)


def _flood(stub: pb_grpc.NodeStub, tokens: int, stop: threading.Event, refused: list[int]) -> None:
    """Relay batches of `tokens` tokens of session "flood" until told to stop: each stream sends
    until the daemon's queue for the session is full (RESOURCE_EXHAUSTED), then another opens."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((tokens, D_MODEL)).astype(np.float32)
    msg = codec.encode_activation(Activation("flood", 1, 0, np.arange(tokens), hidden))
    deadline = time.monotonic() + FLOOD_S

    def batches() -> Iterator[pb.Activation]:
        for _ in range(64):
            if stop.is_set() or time.monotonic() > deadline:
                return
            yield msg

    for _ in range(FLOOD_STREAMS):
        if stop.is_set() or time.monotonic() > deadline:
            return
        try:
            stub.Relay(batches(), timeout=CALL_S)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused.append(1)
            stop.wait(0.05)  # the queue is full: it drains one long batch at a time


def generation_beside_flood(stub: pb_grpc.NodeStub, tokens: int) -> tuple[list[int], list[int], FloodResult]:
    """The tokens a generation gives alone and beside a flood of `tokens`-token batches, and
    the times of both."""
    t0 = time.perf_counter()
    alone = generate(stub)
    solo_s = time.perf_counter() - t0
    # The flood's session may queue two of its batches (its context's worth).
    stub.OpenSession(
        pb.OpenSessionRequest(session_id="flood", plan_epoch=1, n_ctx=2 * tokens), timeout=CALL_S
    )
    stop = threading.Event()
    refused: list[int] = []
    flooder = threading.Thread(target=_flood, args=(stub, tokens, stop, refused))
    flooder.start()
    try:
        while not refused and flooder.is_alive():  # the flood has filled its queue
            stop.wait(0.05)
        t0 = time.perf_counter()
        beside = generate(stub)
        beside_s = time.perf_counter() - t0
    finally:
        stop.set()
        flooder.join(timeout=CALL_S)
        stub.CloseSession(pb.CloseSessionRequest(session_id="flood"), timeout=CALL_S)
    return alone, beside, FloodResult(solo_s, beside_s, len(refused))


def _main() -> None:
    from prima.model.files import resolve_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    ring, channel, stub = start_daemon(str(resolve_model("smollm2-135m")), "--max-batch", str(args.tokens))
    try:
        generate(stub, 1)
        for _ in range(args.runs):
            alone, beside, r = generation_beside_flood(stub, args.tokens)
            print(  # noqa: T201 - the script's output
                f"{len(alone)} tokens, same beside the flood: {alone == beside}; alone {r.solo_s:.2f} s, "
                f"beside {args.tokens}-token batches {r.beside_s:.2f} s ({r.beside_s / r.solo_s:.1f}x)"
            )
    finally:
        channel.close()
        ring.close()


if __name__ == "__main__":
    _main()
