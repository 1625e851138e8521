"""A daemon under session spam, relay floods and oversized messages keeps its memory within a
bound derived from its limits while a normal generation beside them completes with the tokens it
gave before. The daemon is its own process (a one-node local ring, plaintext on 127.0.0.1), and
its memory is read from outside, in /proc/PID/status, before and after.

The bound on what the attack may add to the resident set (VmHWM after - VmRSS before):
  KV caches (--max-kv-mib)
  + activations queued for the compute thread (max_queued_tokens x d_model x 4 bytes)
  + each call in flight: its message three times (gRPC's buffer, the bytes handed to Python,
    the parsed message), each at most the daemon's receive cap (limits.received_message_bytes)
  + working memory (WORKING_MIB: sampling, gRPC and Python allocations).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from prima.coordinator.local_ring import LocalRing
from prima.daemon.runtime import DEFAULT_MAX_BATCH_TOKENS
from prima.net import codec
from prima.net.client import MAX_MESSAGE_BYTES
from prima.net.codec import Activation
from prima.net.limits import DaemonLimits, received_message_bytes
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.plan import plan_from_window_sizes
from tests.cluster.generate_rpc import generate_tokens

pytestmark = pytest.mark.slow

MAX_KV_MIB = 64
D_MODEL = 576  # smollm2-135m
CALLS_IN_FLIGHT = 2  # the attacker below sends from two threads at a time
WORKING_MIB = 128
RECEIVED = received_message_bytes(D_MODEL, DEFAULT_MAX_BATCH_TOKENS)
BOUND_BYTES = (
    (MAX_KV_MIB << 20)
    + DaemonLimits.max_queued_tokens * D_MODEL * 4
    + CALLS_IN_FLIGHT * 3 * RECEIVED
    + (WORKING_MIB << 20)
)
CALL_S = 60


def _status_kib(pid: int, field: str) -> int:
    """A memory figure of process `pid` from /proc/PID/status, in KiB (e.g. VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture(scope="module")
def daemon(smollm2_path: Path) -> Iterator[tuple[pb_grpc.NodeStub, int, int]]:
    extra = ("--exact", "--max-sessions", "4", "--max-kv-mib", str(MAX_KV_MIB))
    ring = LocalRing.start(1, smollm2_path, threads=1, extra_args=extra, plaintext=True)
    channel = grpc.insecure_channel(ring.addresses[0], options=[("grpc.max_send_message_length", -1)])
    stub = pb_grpc.NodeStub(channel)
    plan = plan_from_window_sizes([("node0", ring.addresses[0])], [30], 1, 30, epoch=1)
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="node0"), timeout=CALL_S)
    try:
        yield stub, ring.nodes[0].pid, 1
    finally:
        channel.close()
        ring.close()


def _code(call: object, *args: object) -> grpc.StatusCode:
    try:
        call(*args, timeout=CALL_S)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _activation(session: str, epoch: int, tokens: int, data_bytes: int = 0) -> pb.Activation:
    msg = codec.encode_activation(
        Activation(session, epoch, 0, np.arange(tokens), np.zeros((tokens, D_MODEL), np.float32))
    )
    if data_bytes:  # a tensor whose bytes do not match its shape, as large as asked
        msg.hidden.data = bytes(data_bytes)
    return msg


def _attack(stub: pb_grpc.NodeStub, epoch: int) -> list[grpc.StatusCode]:
    """Session spam, a relay flood and oversized messages; the status of every call."""
    codes = []
    for i in range(40):
        req = pb.OpenSessionRequest(session_id=f"spam{i}", plan_epoch=epoch, n_ctx=8192)
        codes.append(_code(stub.OpenSession, req))
    for i in range(40):
        stub.CloseSession(pb.CloseSessionRequest(session_id=f"spam{i}"), timeout=CALL_S)
    stub.OpenSession(pb.OpenSessionRequest(session_id="flood", plan_epoch=epoch, n_ctx=64), timeout=CALL_S)
    flood = [_activation("flood", epoch, 1) for _ in range(64)]
    oversized = [
        _activation("flood", epoch, 1, MAX_MESSAGE_BYTES + (1 << 20)),  # over any message cap
        _activation("flood", epoch, 1, MAX_MESSAGE_BYTES - (1 << 20)),  # over the receive cap
        _activation("flood", epoch, 1, RECEIVED - (64 << 10)),  # under it, wrong for its shape
        _activation("flood", epoch, 16_000),  # more tokens than a batch may hold
    ]
    lock = threading.Lock()

    def send(batches: list[list[pb.Activation]]) -> None:
        for batch in batches:
            code = _code(stub.Relay, iter(batch))
            with lock:
                codes.append(code)

    senders = [
        threading.Thread(target=send, args=([flood] * 3,)),
        threading.Thread(target=send, args=([[m] for m in oversized] * 2,)),
    ]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=CALL_S * 10)
    stub.CloseSession(pb.CloseSessionRequest(session_id="flood"), timeout=CALL_S)
    return codes


def test_attacks_leave_memory_within_the_bound_and_generation_goes_on(
    daemon: tuple[pb_grpc.NodeStub, int, int],
) -> None:
    stub, pid, epoch = daemon
    expected = generate_tokens(stub)  # also pages the weights in: they are part of the baseline
    before_kib = _status_kib(pid, "VmRSS")
    got: list[list[int]] = []
    beside = threading.Thread(target=lambda: got.append(generate_tokens(stub)))
    beside.start()
    codes = _attack(stub, epoch)
    beside.join(timeout=CALL_S * 4)
    assert got == [expected]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
    peak_kib = _status_kib(pid, "VmHWM")
    grown = (peak_kib - before_kib) << 10
    assert grown <= BOUND_BYTES, f"daemon grew {grown >> 20} MiB, bound {BOUND_BYTES >> 20} MiB"
    assert generate_tokens(stub) == expected  # and it still serves
