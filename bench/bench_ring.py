"""Time per output token through local rings of 2 and 3 primad vs the single engine, same run.

    python bench/bench_ring.py [--model smollm2-135m] [-n 32] [--threads 1] [--reps 10]

Prints ms/token for each setup and the extra cost per hop: (ring - single) / hops per token,
where each ring measurement is paired with a single-engine one taken just before it (a VM's
speed drifts from minute to minute) and the median of `--reps` pairs is shown.
On loopback the aim is < 1 ms per hop per token. Hops per token = nodes x rounds. On a VM
whose speed drifts, one run says little: compare builds by alternating runs of each
(docs/performance.md, "Method").

The hop lines time one activation row alone, over a gRPC Relay stream and over an activation
link (docs/ring.md), back to back ("hot") and 5 ms apart ("idle"), as in a ring, where each node
waits for the others between its hops. Each ring line also says how long the nodes' layers took
per token, as the nodes time their own hops (Info's hop timings): the rest is the head's output
head and sampling, and the ring's own cost."""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import multiprocessing
import queue
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

from prima.backends.base import KVState
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.forward.placement import Piece
from prima.forward.windowed_model import WindowedModel
from prima.net.client import NodeClient, Relay
from prima.net.codec import Activation
from prima.net.link_client import LinkRelay, open_link
from prima.net.link_server import LinkServer
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

    def ms_per_token(self, n: int) -> tuple[float, float]:
        """(ms per token, of which its layers took ms per token)."""
        self._conn.send(n)
        ms, layers = self._conn.recv()
        return float(ms), float(layers)

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(30)


class TimedLayers(WindowedModel):
    """The model, with the time its decode steps spend in the layers added up (as a ring's
    nodes time their hops), so that the ring's extra time splits into slower layers and the
    ring's own cost."""

    decode_ms: float = 0.0

    def run(self, piece: Piece, h: np.ndarray, positions: np.ndarray, cache: KVState) -> np.ndarray:
        t0 = time.perf_counter()
        out = super().run(piece, h, positions, cache)
        if len(positions) == 1:
            self.decode_ms += (time.perf_counter() - t0) * 1000
        return out


def _single_engine(conn: Connection, model: str, threads: int | None) -> None:
    loaded = load_model(model, threads=threads)
    loaded.model.__class__ = TimedLayers
    timed: TimedLayers = loaded.model  # type: ignore[assignment]
    ids = loaded.tokenizer.encode(PROMPT)
    engine = LocalEngine(timed, n_ctx=512)
    generate(engine, ids, max_tokens=4, sampler=SamplerConfig())  # warm up the kernels
    conn.send(ids)
    while (n := conn.recv()) is not None:
        timed.decode_ms = 0.0
        ms = generate(engine, ids, max_tokens=n, sampler=SamplerConfig()).timings.ms_per_token
        # The first token comes from the prompt's pass; the n - 1 after it are decode steps.
        conn.send((ms, timed.decode_ms / max(n - 1, 1)))


def ms_per_token_ring(ring: Ring, ids: list[int], n: int) -> tuple[float, float]:
    """(ms per token, of which the nodes' layers took ms per token: their own hop timings)."""
    list(ring.generate(GenerateRequest(tuple(ids), 4, SamplerConfig(), n_ctx=512)))  # warm up every node
    before = _hop_compute(ring)
    first = None
    count = 0
    for event in ring.generate(GenerateRequest(tuple(ids), n, SamplerConfig(), n_ctx=512)):
        if isinstance(event, int):
            count += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    after = _hop_compute(ring)
    layers = 0.0
    for hop, (steps, ms) in after.items():
        steps_before, ms_before = before.get(hop, (0, 0.0))
        if steps > steps_before:
            layers += (ms - ms_before) / (steps - steps_before)
    return (end - first) * 1000 / max(count - 1, 1), layers


def _hop_compute(ring: Ring) -> dict[int, tuple[int, float]]:
    """(decode steps, compute ms) so far per hop, as each node reports its own hops."""
    found: dict[int, tuple[int, float]] = {}
    for client in ring.clients:
        for t in client.info().hop_times:
            found[t.hop_index] = (t.steps, t.compute_ms)
    return found


class Sink:
    """A node that only notes when each activation arrives (plaintext, loopback: anyone may relay)."""

    max_batch_tokens = 64

    def __init__(self, d_model: int) -> None:
        self.d_model = d_model
        self.arrived: queue.SimpleQueue[float] = queue.SimpleQueue()

    def accept(self, act: Activation) -> None:
        self.arrived.put(time.perf_counter())

    def authorize(self, rpc: str, caller: str | None) -> None:
        """Any caller may relay here."""

    def one_way_ms(self, relay: Relay, n: int, gap_s: float) -> float:
        """Median ms from `send` to arrival of one row, over `n` rows sent `gap_s` apart."""
        row = np.zeros((1, self.d_model), np.float32)
        times = []
        for i in range(n):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            relay.send(Activation("bench", 1, 0, np.array([i]), row))
            times.append((self.arrived.get(timeout=10) - t0) * 1000)
        return float(np.median(times))


def relay_hop_ms(d_model: int, n: int = 200, gap_s: float = 0.0) -> float:
    """Median one-way time of one activation row over a Relay stream on loopback (encode, send,
    decode, validate), sent `gap_s` after the last one arrived: the network part of a hop,
    without any layer compute."""
    sink = Sink(d_model)
    server, port = start_server(sink, "127.0.0.1", 0)  # type: ignore[arg-type]
    client = NodeClient(f"127.0.0.1:{port}")
    relay = client.relay(lambda err: None)
    ms = sink.one_way_ms(relay, n, gap_s)
    relay.close()
    client.close()
    server.stop(None)
    return ms


def link_hop_ms(d_model: int, n: int = 200, gap_s: float = 0.0) -> float:
    """The same over an activation link (plaintext here; the ring's daemons speak TLS)."""
    sink = Sink(d_model)
    server = LinkServer(sink, "127.0.0.1", 0, identity=None)
    relay = LinkRelay(open_link("127.0.0.1", server.port, None, None), "sink", "127.0.0.1", lambda err: None)
    ms = sink.one_way_ms(relay, n, gap_s)
    relay.close()
    server.close()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=32, help="tokens to generate per measurement")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per process")
    ap.add_argument("--reps", type=int, default=10, help="(single, ring) pairs per setup")
    args = ap.parse_args()
    single = SingleEngine(args.model, args.threads)
    d_model = load_model(args.model, layers=range(0)).model.config.d_model
    for name, timed in (("gRPC Relay", relay_hop_ms), ("activation link", link_hop_ms)):
        hot, idle = timed(d_model), timed(d_model, n=100, gap_s=0.005)
        print(
            f"hop on loopback, {name:15s}: {hot:6.3f} ms hot, {idle:.3f} ms idle, one way per row (d={d_model})"
        )
    with LocalRing.start(3, load_model(args.model, layers=range(0)).path, threads=args.threads) as local:
        for n_nodes, rounds in [(2, 1), (3, 1), (3, 2)]:
            ring = Ring.connect(local.addresses[:n_nodes], rounds=rounds)
            hops = n_nodes * rounds
            pairs = [
                (*single.ms_per_token(args.n), *ms_per_token_ring(ring, single.ids, args.n))
                for _ in range(args.reps)
            ]
            ring.close()
            alone = statistics.median(p[0] for p in pairs)
            ringed = statistics.median(p[2] for p in pairs)
            extra = statistics.median((r - s) / hops for s, _, r, _ in pairs)
            slower = statistics.median((rl - sl) / hops for _, sl, _, rl in pairs)
            own = statistics.median(((r - rl) - (s - sl)) / hops for s, sl, r, rl in pairs)
            print(
                f"ring {n_nodes} nodes x {rounds} round(s): {ringed:6.2f} ms/token vs {alone:.2f} single, "
                f"{extra:5.2f} ms extra per hop ({hops} hops/token): the layers {slower:5.2f} slower, "
                f"the ring's own {own:5.2f}"
            )
    single.close()


if __name__ == "__main__":
    main()
