"""A device joins without the model file (#17): a 3-node ring where only node 0 holds the file.
The followers start with an empty directory and `--fetch-from` node 0, fetch the bytes of their
windows when the plan arrives (in the background; the coordinator waits, as `prima run` does),
and the ring then generates. Prints the transfer time, each follower's bytes held against its
share and the blocks its sparse file takes on disk, and the tokens of a short greedy run.

    python bench/bench_fetch.py [--model PATH | --size 1.04G] [--nodes 3] [-n 8] [--threads 1]
                                [--json]

The synthetic model (`prima models synth`, as bench_scale.py uses) is written once into the
cache and reused. Timings only mean something on a quiet machine; run it there.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_scale import synth_model

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.readiness import RingFetch
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerateRequest, GenerationDone
from prima.engine.sampling import SamplerConfig
from prima.model.byte_ranges import needed_ranges, total_bytes
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile

MiB = 1 << 20
PROMPT_IDS = (1, 450, 7483, 310, 3444, 338)  # any ids inside the vocabulary: the weights are random


@dataclass
class Follower:
    node_id: str
    windows: str
    share_bytes: int  # what its windows need (header, its layers' tensors, small tensors)
    held_bytes: int  # what its sparse file holds
    allocated_bytes: int  # disk blocks its file takes
    file_bytes: int  # the file's apparent size (the whole model's)


@dataclass
class Result:
    model: str
    model_bytes: int
    nodes: int
    transfer_s: float  # LoadPlan sent to every node holding its windows
    fetched_mib_per_s: float
    followers: list[Follower]
    token_ids: list[int]


def run(model: Path, n_nodes: int, n_tokens: int, threads: int, work: Path) -> Result:
    files = [work / f"node{i}" / "model.gguf" for i in range(1, n_nodes)]
    with LocalRing.start(1, model, threads=threads, log_dir=work / "logs-holder") as holder:
        with LocalRing.start(
            n_nodes - 1,
            model,
            models=files,
            names=[f"node{i}" for i in range(1, n_nodes)],
            threads=threads,
            log_dir=work / "logs-followers",
            extra_args=("--fetch-from", holder.addresses[0]),
        ) as followers:
            before = sum(SparseFile.open(f).held_bytes() for f in files)
            reports: list[RingFetch] = []
            t0 = time.perf_counter()
            ring = Ring.connect([*holder.addresses, *followers.addresses], on_fetch=reports.append)
            transfer_s = time.perf_counter() - t0
            try:
                request = GenerateRequest(PROMPT_IDS, n_tokens, SamplerConfig(), (), n_ctx=128)
                events = list(ring.generate(request))
                assert isinstance(events[-1], GenerationDone)
                token_ids = [t for t in events if isinstance(t, int)]
                plan = ring.plan
            finally:
                ring.close()
    with GGUFFile(model) as gguf:
        shares = [
            total_bytes(needed_ranges(gguf, plan.nodes[i].windows, head=False)) for i in range(1, n_nodes)
        ]
    out = []
    for i, (f, share) in enumerate(zip(files, shares, strict=True), start=1):
        store = SparseFile.open(f)
        out.append(
            Follower(
                plan.nodes[i].node_id,
                " ".join(map(str, plan.nodes[i].windows)),
                share,
                store.held_bytes(),
                store.allocated_bytes(),
                f.stat().st_size,
            )
        )
    fetched = sum(x.held_bytes for x in out) - before
    return Result(
        str(model),
        model.stat().st_size,
        n_nodes,
        transfer_s,
        fetched / MiB / transfer_s if transfer_s else 0.0,
        out,
        token_ids,
    )


def report(r: Result) -> None:
    print(f"model {r.model} ({r.model_bytes / MiB:.0f} MiB), {r.nodes} nodes, only node0 holds the file")
    print(
        f"transfer: {r.transfer_s:.1f} s until every node held its windows ({r.fetched_mib_per_s:.0f} MiB/s)"
    )
    for f in r.followers:
        print(
            f"  {f.node_id} windows {f.windows}: holds {f.held_bytes / MiB:.0f} MiB of its "
            f"{f.share_bytes / MiB:.0f} MiB share; {f.allocated_bytes / MiB:.0f} MiB allocated on disk "
            f"of a {f.file_bytes / MiB:.0f} MiB file"
        )
    print(f"tokens: {r.token_ids}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF to run (default: a synthetic model of --size)")
    p.add_argument("--size", default="1.04G", help="size of the synthetic model (default 1.04G)")
    p.add_argument("--nodes", type=int, default=3, help="ring size, node 0 the only holder (default 3)")
    p.add_argument("-n", type=int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--threads", type=int, default=1, help="compute threads per daemon (default 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    if args.nodes < 2:
        p.error("--nodes must be at least 2: node 0 holds the file, the others fetch")
    model = Path(args.model) if args.model else synth_model(args.size)
    with tempfile.TemporaryDirectory(prefix="prima-bench-fetch-") as tmp:
        result = run(model, args.nodes, args.n, args.threads, Path(tmp))
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        report(result)
    ok = all(f.held_bytes == f.share_bytes for f in result.followers)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
