"""A relay flood from four threads at once, over gRPC or the activation link (the longest micro-
batches a daemon takes, and messages just under and far over what it receives) keeps the
daemon's memory within the bound docs/security.md states, read from outside the daemon's process
while the flood runs, and a generation beside it gives the tokens it gives alone. The daemon is
its own process (a one-node local ring, plaintext on 127.0.0.1).

The bound on the growth of its peak resident set (VmHWM during - VmRSS before):
  KV caches (--max-kv-mib)
  + activations queued for the compute thread (max_queued_tokens x d_model x 4 bytes)
  + each call in flight (one per attacking thread, THREADS): its message three times (gRPC's buffer,
    the bytes handed to Python, the parsed message), each at most the daemon's receive cap
    (limits.received_message_bytes: for SmolLM2's 512-token batches, 4 MiB)
  + working memory (WORKING_MIB).
Before that cap, any message up to 64 MiB was received whole: four threads on gRPC grew the daemon
by 515-800 MiB, sixteen on the link by about 1 GiB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from prima.coordinator.local_ring import LocalRing
from prima.daemon.runtime import DEFAULT_MAX_BATCH_TOKENS
from prima.net import codec
from prima.net.limits import DaemonLimits, received_message_bytes
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.server import MAX_WORKERS
from prima.plan import plan_from_window_sizes
from tests.cluster import relay_flood
from tests.cluster.generate_rpc import generate_tokens

pytestmark = pytest.mark.slow

MAX_KV_MIB = 64
# Attacking threads: four on gRPC as issue 38's probe; sixteen on the link, which takes up to 64
# connections at once (each holds one frame while it reads it).
THREADS = {"grpc": 4, "link": 16}
STREAMS = 4  # per thread
WORKING_MIB = 128
RECEIVED = received_message_bytes(relay_flood.D_MODEL, DEFAULT_MAX_BATCH_TOKENS)


def bound_bytes(threads: int) -> int:
    return (
        (MAX_KV_MIB << 20)
        + DaemonLimits.max_queued_tokens * relay_flood.D_MODEL * 4
        + threads * 3 * RECEIVED
        + (WORKING_MIB << 20)
    )


CALL_S = 60


@pytest.fixture(scope="module")
def daemon(smollm2_path: Path) -> Iterator[tuple[pb_grpc.NodeStub, int]]:
    extra = ("--exact", "--max-kv-mib", str(MAX_KV_MIB))
    ring = LocalRing.start(1, smollm2_path, threads=1, extra_args=extra, plaintext=True)
    channel = grpc.insecure_channel(ring.addresses[0], options=[("grpc.max_send_message_length", -1)])
    stub = pb_grpc.NodeStub(channel)
    plan = plan_from_window_sizes([("node0", ring.addresses[0])], [30], 1, 30, epoch=1)
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="node0"), timeout=CALL_S)
    try:
        yield stub, ring.nodes[0].pid
    finally:
        channel.close()
        ring.close()


@pytest.mark.parametrize("transport", ["grpc", "link"])
@pytest.mark.parametrize(
    "message_bytes",
    [RECEIVED - (64 << 10), 63 << 20],
    ids=["just-under-the-receive-cap", "63MiB"],
)
def test_a_four_thread_relay_flood_stays_within_the_stated_bound(
    daemon: tuple[pb_grpc.NodeStub, int], message_bytes: int, transport: str
) -> None:
    """On gRPC's Relay and on the activation link, which the same cap bounds."""
    stub, pid = daemon
    expected = generate_tokens(stub)  # also pages the weights in: they are part of the baseline
    threads_before = relay_flood.status(pid)["Threads"]
    got: list[list[int]] = []
    run = relay_flood.run if transport == "grpc" else relay_flood.run_link
    threads = THREADS[transport]
    bound = bound_bytes(threads)
    watch, answers, before_kib = run(
        stub,
        pid,
        1,
        message_bytes,
        threads,
        STREAMS,
        CALL_S * 2,
        beside=lambda: got.append(generate_tokens(stub)),
    )
    assert got == [expected]
    assert len(answers) == threads * STREAMS
    refusals = {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}
    assert {getattr(a, "name", a) for a in answers} <= refusals
    grown = (watch.peak_hwm_kib - before_kib) << 10
    print(  # noqa: T201 - the measurement, for the record
        f"{transport}: {message_bytes >> 20} MiB messages from {threads} threads: grew {grown >> 20} MiB "
        f"(bound {bound >> 20}), threads {threads_before} -> at most {watch.peak_threads}"
    )
    assert grown <= bound, f"daemon grew {grown >> 20} MiB, bound {bound >> 20} MiB"
    assert watch.peak_threads <= threads_before + MAX_WORKERS
    assert generate_tokens(stub) == expected  # and it still serves
