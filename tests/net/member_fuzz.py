"""A member's fuzz of a daemon that runs as its own process: `calls` seeded random and mutated
messages over every RPC, sent over mutual TLS with a node certificate of the ring's cluster (the
most a hostile member holds), while the daemon's resident set and threads are sampled from
/proc. Afterwards a normal generation must give the tokens it gave before. Used by
test_member_fuzz.py; `python -m tests.net.member_fuzz --calls 10000` runs the full count."""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from prima.coordinator.local_ring import LocalRing
from prima.engine.sampling import SamplerConfig
from prima.net import codec, credentials
from prima.net.client import open_channel
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.plan import plan_from_window_sizes
from tests.net.fuzz_messages import BAD_CODES, FILE_SIZE, FINGERPRINT, activation, message, send, should_fail

RPCS = [
    "LoadPlan",
    "OpenSession",
    "CloseSession",
    "Abort",
    "Relay",
    "Profile",
    "Ping",
    "Info",
    "FetchRanges",
    "Manifest",
    "Generate",
]
N_LAYERS = 30  # smollm2-135m
PROMPT = [1, 504, 3458, 282, 4649, 314]
SAMPLE_EVERY = 250
CALL_S = 60
# The daemon under fuzz: small bounds, so floods reach them.
DAEMON_ARGS = ("--exact", "--max-sessions", "4", "--max-kv-mib", "64", "--max-batch", "8")


@dataclass
class FuzzReport:
    codes: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)  # UNKNOWN/INTERNAL, DEADLINE_EXCEEDED, silent OKs
    rss_kib: list[int] = field(default_factory=list)  # sampled every SAMPLE_EVERY calls
    threads: list[int] = field(default_factory=list)
    hwm_kib: int = 0
    exited: int | None = None  # the daemon's exit code, had it died
    seconds: float = 0.0


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.split() and value.split()[0].isdigit():
            out[key] = int(value.split()[0])
    return out


def start_daemon(model: Path) -> tuple[LocalRing, grpc.Channel, pb_grpc.NodeStub]:
    """One primad over mutual TLS, and a channel to it as a member (a node certificate)."""
    ring = LocalRing.start(1, model, threads=1, extra_args=DAEMON_ARGS)
    member = credentials.local_ca().issue("fuzzing-member")
    channel = open_channel(ring.addresses[0], member)
    return ring, channel, pb_grpc.NodeStub(channel)


def load_plan(stub: pb_grpc.NodeStub, ring: LocalRing, epoch: int) -> None:
    node = ring.nodes[0]
    plan = plan_from_window_sizes([(node.node_id, node.address)], [N_LAYERS], 1, N_LAYERS, epoch=epoch)
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id=node.node_id), timeout=CALL_S)


def generate(stub: pb_grpc.NodeStub) -> list[int]:
    req = pb.GenerateRequest(
        prompt_ids=PROMPT, max_tokens=4, sampler=codec.sampler_to_proto(SamplerConfig()), n_ctx=32
    )
    return [r.token_id for r in stub.Generate(req, timeout=CALL_S) if not r.done]


def fuzz(ring: LocalRing, stub: pb_grpc.NodeStub, calls: int, seed: int, deadline_s: float) -> FuzzReport:
    """Send up to `calls` fuzzed messages (stopping after `deadline_s`); what came back."""
    pid, port = ring.nodes[0].pid, int(ring.addresses[0].rpartition(":")[2])
    manifest = stub.Manifest(pb.ManifestRequest(), timeout=CALL_S)
    FINGERPRINT[0], FILE_SIZE[0] = manifest.model_fingerprint, manifest.file_size
    rng = random.Random(seed)
    report = FuzzReport()
    t0 = time.monotonic()
    for i in range(calls):
        if time.monotonic() - t0 > deadline_s or ring.procs[0].poll() is not None:
            break
        if i % SAMPLE_EVERY == 0:
            s = _status(pid)
            report.rss_kib.append(s["VmRSS"])
            report.threads.append(s["Threads"])
        rpc = rng.choice(RPCS)
        msg = activation(rng) if rpc == "Relay" else message(rng, rpc, port)
        code = send(stub, rpc, msg)
        report.codes[f"{rpc} {code.name}"] += 1
        silent = code == grpc.StatusCode.OK and should_fail(rpc, msg)
        if code in BAD_CODES or code == grpc.StatusCode.DEADLINE_EXCEEDED or silent:
            report.wrong.append(f"call {i}, {rpc}: {code.name} for {str(msg)[:200]!r}")
    report.seconds = time.monotonic() - t0
    report.exited = ring.procs[0].poll()
    if report.exited is None:
        s = _status(pid)
        report.rss_kib.append(s["VmRSS"])
        report.threads.append(s["Threads"])
        report.hwm_kib = s["VmHWM"]
    return report


def _main() -> None:
    from prima.model.files import resolve_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--minutes", type=float, default=20)
    args = ap.parse_args()
    ring, channel, stub = start_daemon(resolve_model("smollm2-135m"))
    try:
        load_plan(stub, ring, 1)
        before = generate(stub)
        report = fuzz(ring, stub, args.calls, args.seed, args.minutes * 60)
        sent = sum(report.codes.values())
        load_plan(stub, ring, stub.Info(pb.InfoRequest(), timeout=CALL_S).plan_epoch + 1)
        after = generate(stub)
        print(  # noqa: T201 - the script's output
            f"{sent} calls in {report.seconds:.0f} s; wrong: {len(report.wrong)}; daemon exited: {report.exited}; "
            f"generation after == before: {after == before}\n"
            f"RSS MiB sampled every {SAMPLE_EVERY} calls: {[k >> 10 for k in report.rss_kib]}\n"
            f"threads: {report.threads}; VmHWM {report.hwm_kib >> 10} MiB\n"
            f"statuses: {dict(sorted(report.codes.items()))}"
        )
        for w in report.wrong[:30]:
            print("  " + w)  # noqa: T201
    finally:
        channel.close()
        ring.close()


if __name__ == "__main__":
    _main()
