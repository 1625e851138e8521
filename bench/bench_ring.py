"""Time per output token through local rings of 2 and 3 primad vs the single engine, same run.

    python bench/bench_ring.py [--model smollm2-135m] [-n 32] [--threads 1]

Prints ms/token for each setup and the extra cost per hop: (ring - single) / hops per token.
On loopback the aim is < 1 ms per hop per token. Hops per token = nodes x rounds."""

from __future__ import annotations

import argparse
import queue
import time

import numpy as np

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.net.client import NodeClient
from prima.net.codec import Activation
from prima.net.server import start_server

PROMPT = "The capital of France is"


def ms_per_token_local(model: str, n: int, threads: int | None) -> tuple[float, list[int]]:
    loaded = load_model(model, threads=threads)
    ids = loaded.tokenizer.encode(PROMPT)
    engine = LocalEngine(loaded.model, n_ctx=512)
    generate(engine, ids, max_tokens=4, sampler=SamplerConfig())  # warm up the kernels
    result = generate(engine, ids, max_tokens=n, sampler=SamplerConfig())
    return result.timings.ms_per_token, ids


def ms_per_token_ring(ring: Ring, ids: list[int], n: int) -> float:
    list(ring.generate(GenerateRequest(tuple(ids), 4, SamplerConfig(), n_ctx=512)))  # warm up every node
    t0 = time.perf_counter()
    first = None
    count = 0
    for event in ring.generate(GenerateRequest(tuple(ids), n, SamplerConfig(), n_ctx=512)):
        if isinstance(event, int):
            count += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    del t0
    return (end - first) * 1000 / max(count - 1, 1)


def relay_hop_ms(d_model: int, n: int = 200) -> float:
    """Median one-way time of one activation row over a Relay stream on loopback (encode, send,
    decode, validate): the network part of a hop, without any layer compute."""
    got: queue.SimpleQueue[float] = queue.SimpleQueue()

    class Sink:
        max_batch_tokens = 64

        def __init__(self) -> None:
            self.d_model = d_model

        def accept(self, act: Activation) -> None:
            got.put(time.perf_counter())

        def authorize(self, rpc: str, caller: str | None) -> None:
            """Any caller may relay here (a plaintext loopback server)."""

    server, port = start_server(Sink(), "127.0.0.1", 0)  # type: ignore[arg-type]
    client = NodeClient(f"127.0.0.1:{port}")
    relay = client.relay(lambda err: None)
    row = np.zeros((1, d_model), np.float32)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        relay.send(Activation("bench", 1, 0, np.array([i]), row))
        times.append((got.get(timeout=10) - t0) * 1000)
    relay.close()
    client.close()
    server.stop(None)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=32, help="tokens to generate per measurement")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per process")
    args = ap.parse_args()
    single, ids = ms_per_token_local(args.model, args.n, args.threads)
    d_model = load_model(args.model, layers=range(0)).model.config.d_model
    print(f"relay hop (loopback) : {relay_hop_ms(d_model):8.3f} ms one-way per activation row (d={d_model})")
    print(f"single engine        : {single:8.2f} ms/token")
    with LocalRing.start(3, load_model(args.model, layers=range(0)).path, threads=args.threads) as local:
        for n_nodes, rounds in [(2, 1), (3, 1), (3, 2)]:
            ring = Ring.connect(local.addresses[:n_nodes], rounds=rounds)
            ms = ms_per_token_ring(ring, ids, args.n)
            hops = n_nodes * rounds
            print(
                f"ring {n_nodes} nodes x {rounds} round(s): {ms:8.2f} ms/token, "
                f"{(ms - single) / hops:6.2f} ms extra per hop ({hops} hops/token)"
            )
            ring.close()


if __name__ == "__main__":
    main()
