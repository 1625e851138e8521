"""A daemon under hostile input: seeded random and mutated messages on every RPC never get an
UNKNOWN or INTERNAL status, never a silent OK for a message that breaks the protocol, and a
normal generation afterwards equals the one before; floods of sessions and activations are
answered with RESOURCE_EXHAUSTED while a normal generation goes on. One in-process daemon on
127.0.0.1 that is its own whole ring (a one-node plan), so Generate runs here too."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.engine.sampling import SamplerConfig
from prima.errors import ProtocolError
from prima.forward.loader import load_model
from prima.net import codec
from prima.net.codec import Activation
from prima.net.limits import DaemonLimits, check_address
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.server import start_server
from prima.net.status import PermissionDeniedError
from prima.plan import plan_from_window_sizes
from tests.net.fuzz_messages import BAD_CODES, FILE_SIZE, FINGERPRINT, activation, message, send, should_fail

N_MESSAGES = 2500
SEED = 12
BOUNDS = DaemonLimits(max_sessions=4, max_kv_bytes=64 << 20, max_queued_tokens=16)
PROMPT = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def node(smollm2_path: Path) -> Iterator[tuple[pb_grpc.NodeStub, NodeRuntime, int]]:
    loaded = load_model(smollm2_path, layers=range(0), mode="exact")
    runtime = NodeRuntime(loaded, "solo", max_batch_tokens=8, identity="plaintext", bounds=BOUNDS)
    server, port = start_server(runtime, "127.0.0.1", 0, max_message_bytes=1 << 20)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.NodeStub(channel)
    _load(stub, port, epoch=1)
    yield stub, runtime, port
    channel.close()
    server.stop(grace=None)
    runtime.shutdown()


def _load(stub: pb_grpc.NodeStub, port: int, epoch: int) -> None:
    plan = plan_from_window_sizes([("solo", f"127.0.0.1:{port}")], [30], 1, 30, epoch=epoch)
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="solo"), timeout=60)


def _generate(stub: pb_grpc.NodeStub, max_tokens: int = 4) -> list[int]:
    req = pb.GenerateRequest(
        prompt_ids=PROMPT, max_tokens=max_tokens, sampler=codec.sampler_to_proto(SamplerConfig()), n_ctx=32
    )
    return [r.token_id for r in stub.Generate(req, timeout=60) if not r.done]


def test_fuzzed_messages_get_precise_statuses(node: tuple[pb_grpc.NodeStub, NodeRuntime, int]) -> None:
    stub, runtime, port = node
    before = _generate(stub)
    rng = random.Random(SEED)
    rpcs = ["LoadPlan", "OpenSession", "CloseSession", "Abort", "Relay", "Profile", "Ping", "Info"]
    rpcs += ["FetchRanges", "Manifest"]
    FINGERPRINT[0], FILE_SIZE[0] = runtime.fingerprint, runtime.store.file_size
    wrong = []
    seen: set[tuple[str, grpc.StatusCode]] = set()
    for i in range(N_MESSAGES):
        rpc = "Generate" if i % 100 == 0 else rng.choice(rpcs)
        msg = activation(rng) if rpc == "Relay" else message(rng, rpc, port)
        code = send(stub, rpc, msg)
        seen.add((rpc, code))
        if code in BAD_CODES or (code == grpc.StatusCode.OK and should_fail(rpc, msg)):
            wrong.append(f"{rpc}: {code.name} for {str(msg)[:200]!r}")
    assert not wrong, "\n".join(wrong[:20])
    # Both sides of the fetch RPCs were reached: pieces served (and checked), requests refused.
    assert {("FetchRanges", grpc.StatusCode.OK), ("FetchRanges", grpc.StatusCode.INVALID_ARGUMENT)} <= seen
    assert ("Manifest", grpc.StatusCode.OK) in seen
    _load(stub, port, epoch=stub.Info(pb.InfoRequest(), timeout=10).plan_epoch + 1)
    assert _generate(stub) == before


def test_error_messages_do_not_echo_long_strings(node: tuple[pb_grpc.NodeStub, NodeRuntime, int]) -> None:
    stub = node[0]
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(pb.OpenSessionRequest(session_id="x" * 500_000, plan_epoch=1, n_ctx=8), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(info.value.details()) < 300


def test_session_spam_is_bounded_and_generation_goes_on(
    node: tuple[pb_grpc.NodeStub, NodeRuntime, int],
) -> None:
    stub, runtime, port = node
    _load(stub, port, epoch=stub.Info(pb.InfoRequest(), timeout=10).plan_epoch + 1)
    expected = _generate(stub)
    epoch = runtime.plan.epoch
    codes = [
        send(stub, "OpenSession", pb.OpenSessionRequest(session_id=f"spam{i}", plan_epoch=epoch, n_ctx=8192))
        for i in range(50)
    ]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert runtime.sessions.held_kv_bytes() <= BOUNDS.max_kv_bytes
    for i in range(50):
        stub.CloseSession(pb.CloseSessionRequest(session_id=f"spam{i}"), timeout=10)
    # A relay flood on its own session while a normal generation runs beside it.
    stub.OpenSession(pb.OpenSessionRequest(session_id="flood", plan_epoch=epoch, n_ctx=64), timeout=10)
    flood = [
        codec.encode_activation(Activation("flood", epoch, 0, np.array([i]), np.zeros((1, 576), np.float32)))
        for i in range(64)
    ]
    flood_codes: list[grpc.StatusCode] = []
    flooder = threading.Thread(
        target=lambda: flood_codes.extend(send(stub, "Relay", flood) for _ in range(3))
    )
    flooder.start()
    got = _generate(stub)
    flooder.join(timeout=120)
    assert got == expected
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in flood_codes
    assert set(flood_codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_only_the_plans_coordinator_and_nodes_may_touch_it(
    node: tuple[pb_grpc.NodeStub, NodeRuntime, int],
) -> None:
    """Callers are named by their certificates (here passed as the servicer would)."""
    stub, runtime, port = node
    epoch = runtime.plan.epoch + 1
    plan = plan_from_window_sizes([("solo", f"127.0.0.1:{port}")], [30], 1, 30, epoch=epoch)
    runtime.load_plan(plan, "solo", codec.WireDType.F32, owner="coord-a")
    runtime.open_session("mine", epoch, 16)
    with pytest.raises(PermissionDeniedError, match="coord-a"):
        runtime.authorize("LoadPlan", "coord-b")
    with pytest.raises(PermissionDeniedError, match="neither a node"):
        runtime.authorize("OpenSession", "coord-b")
    runtime.authorize("LoadPlan", "coord-a")
    runtime.authorize("Relay", "solo")
    runtime.close_session("mine")
    runtime.authorize("LoadPlan", "coord-b")  # an idle plan may be taken over
    for bad_epoch in (0, epoch + (1 << 21)):
        bad = plan_from_window_sizes([("solo", f"127.0.0.1:{port}")], [30], 1, 30, epoch=bad_epoch)
        with pytest.raises(ProtocolError, match="epoch"):
            runtime.load_plan(bad, "solo", codec.WireDType.F32)
    _load(stub, port, epoch=epoch + 1)


@pytest.mark.parametrize(
    "address", ["unix:/tmp/s", "unix-abstract:x", "dns:///h:1", "h", "h:0", "h:x", "a:b:1"]
)
def test_peer_addresses_must_be_host_and_port(address: str) -> None:
    with pytest.raises(ProtocolError, match="host:port"):
        check_address(address)


@pytest.mark.parametrize("address", ["127.0.0.1:7600", "phone.local:1", "[::1]:7600"])
def test_host_and_port_addresses_pass(address: str) -> None:
    check_address(address)
