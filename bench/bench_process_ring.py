"""The floor under a ring on this machine: how much slower a model's layers run when they are
spread over several plain processes that pass each token's row round through pipes, with no
primad, no network and no TLS, against one process computing them all.

    python bench/bench_process_ring.py [--model smollm2-135m] [-n 200] [--nodes 3] [--runs 2]

Each process times only its own layers, as a ring's nodes time their hops, so the difference is
what computing in turns on shared cores costs the layers themselves (caches, scheduling); a
ring of primad pays it too. bench/bench_ring.py reports how much slower its nodes' layers were
beside the ring's own cost; compare the former with this."""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import itertools
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

from prima.forward.loader import load_model
from prima.forward.placement import split_window

WARM_UP_TOKENS = 20


def _node(
    model: str, layers: range, n_ctx: int, inbox: Connection, outbox: Connection, report: Connection
) -> None:
    """Compute `layers` for every (position, row) that arrives and pass the row on; at the end (a
    None), pass that on and `report` the median ms a token spent in these layers."""
    m = load_model(model, threads=1).model
    pieces = split_window(layers, 0)
    cache = m.new_split_cache(n_ctx, [], list(layers))
    spent = []
    while (item := inbox.recv()) is not None:
        position, h = item
        positions = np.array([position], dtype=np.int64)
        t0 = time.perf_counter()
        for piece in pieces:
            h = m.run(piece, h, positions, cache)
        spent.append((time.perf_counter() - t0) * 1000)
        outbox.send((position, h))
    outbox.send(None)
    report.send(statistics.median(spent[WARM_UP_TOKENS:]))


def layers_ms_per_token(model: str, spans: list[range], n: int) -> float:
    """Median ms per token in the layers, summed over processes that each hold one of `spans`
    and pass a row round `n` times."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(len(spans) + 1)]  # (read end, write end)
    reports = [ctx.Pipe(duplex=False) for _ in spans]
    procs = [
        ctx.Process(
            target=_node, args=(model, span, n + 1, pipes[i][0], pipes[i + 1][1], reports[i][1]), daemon=True
        )
        for i, span in enumerate(spans)
    ]
    for p in procs:
        p.start()
    first, last = pipes[0][1], pipes[-1][0]
    row = np.full((1, load_model(model, layers=range(0)).model.config.d_model), 0.01, np.float32)
    for position in range(n):
        first.send((position, row))
        _, row = last.recv()
    first.send(None)
    total = sum(float(r.recv()) for r, _ in reports)
    for p in procs:
        p.join(30)
    return total


def _spans(n_layers: int, nodes: int) -> list[range]:
    cuts = [round(i * n_layers / nodes) for i in range(nodes + 1)]
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=200, help="tokens passed round per measurement")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2, help="(one process, ring) pairs")
    args = ap.parse_args()
    n_layers = load_model(args.model, layers=range(0)).model.config.n_layers
    for _ in range(args.runs):
        one = layers_ms_per_token(args.model, [range(n_layers)], args.n)
        ring = layers_ms_per_token(args.model, _spans(n_layers, args.nodes), args.n)
        print(
            f"layers per token: one process {one:.2f} ms, {args.nodes} processes {ring:.2f} ms "
            f"({(ring - one) / args.nodes:+.2f} ms per hop)"
        )


if __name__ == "__main__":
    main()
