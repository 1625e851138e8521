"""Time per output token through local rings of 2 and 3 primad vs the single engine, same run.

    python bench/bench_ring.py [--model smollm2-135m] [-n 32] [--threads 1] [--reps 3]

Prints ms/token for each setup and the extra cost per hop: (ring - single) / hops per token,
where each ring measurement is paired with a single-engine one taken just before it (a VM's
speed drifts from minute to minute) and the median of `--reps` pairs is shown.
On loopback the aim is < 1 ms per hop per token. Hops per token = nodes x rounds.

The relay line times one activation row over a Relay stream alone, back to back ("hot") and
5 ms apart ("idle"), as in a ring, where each node waits for the others between its hops."""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import time
from multiprocessing.connection import Connection

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


class SingleEngine:
    """The model on one device, the baseline each ring is compared with. It runs in a process of
    its own, as `prima run` would: in this one, the rings' gRPC threads would take turns with it."""

    def __init__(self, model: str, threads: int | None) -> None:
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._proc = multiprocessing.get_context("spawn").Process(
            target=_single_engine, args=(child, model, threads), daemon=True
        )
        self._proc.start()
        child.close()  # so that a worker that dies ends our reads (EOFError), not hangs them
        self.ids: list[int] = self._conn.recv()

    def ms_per_token(self, n: int) -> float:
        self._conn.send(n)
        return float(self._conn.recv())

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(30)


def _single_engine(conn: Connection, model: str, threads: int | None) -> None:
    loaded = load_model(model, threads=threads)
    ids = loaded.tokenizer.encode(PROMPT)
    engine = LocalEngine(loaded.model, n_ctx=512)
    generate(engine, ids, max_tokens=4, sampler=SamplerConfig())  # warm up the kernels
    conn.send(ids)
    while (n := conn.recv()) is not None:
        conn.send(generate(engine, ids, max_tokens=n, sampler=SamplerConfig()).timings.ms_per_token)


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


def relay_hop_ms(d_model: int, n: int = 200, gap_s: float = 0.0) -> float:
    """Median one-way time of one activation row over a Relay stream on loopback (encode, send,
    decode, validate), sent `gap_s` after the last one arrived: the network part of a hop,
    without any layer compute."""
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
        if gap_s:
            time.sleep(gap_s)
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
    ap.add_argument("--reps", type=int, default=3, help="(single, ring) pairs per setup")
    args = ap.parse_args()
    single = SingleEngine(args.model, args.threads)
    d_model = load_model(args.model, layers=range(0)).model.config.d_model
    hot, idle = relay_hop_ms(d_model), relay_hop_ms(d_model, n=100, gap_s=0.005)
    print(f"relay hop (loopback) : {hot:8.3f} ms hot, {idle:.3f} ms idle, one way per row (d={d_model})")
    with LocalRing.start(3, load_model(args.model, layers=range(0)).path, threads=args.threads) as local:
        for n_nodes, rounds in [(2, 1), (3, 1), (3, 2)]:
            ring = Ring.connect(local.addresses[:n_nodes], rounds=rounds)
            hops = n_nodes * rounds
            pairs = [
                (single.ms_per_token(args.n), ms_per_token_ring(ring, single.ids, args.n))
                for _ in range(args.reps)
            ]
            ring.close()
            alone = statistics.median(p[0] for p in pairs)
            ringed = statistics.median(p[1] for p in pairs)
            extra = statistics.median((r - s) / hops for s, r in pairs)
            print(
                f"ring {n_nodes} nodes x {rounds} round(s): {ringed:8.2f} ms/token vs {alone:.2f} single, "
                f"{extra:6.2f} ms extra per hop ({hops} hops/token)"
            )
    single.close()


if __name__ == "__main__":
    main()
