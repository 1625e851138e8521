"""A daemon under hostile input: seeded random and mutated messages on every RPC never get an
UNKNOWN or INTERNAL status, never a silent OK for a message that breaks the protocol, and a
normal generation afterwards equals the one before; floods of sessions and activations are
answered with RESOURCE_EXHAUSTED while a normal generation goes on. One in-process daemon on
127.0.0.1 that is its own whole ring (a one-node plan), so Generate runs here too."""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.engine.sampling import SamplerConfig
from prima.errors import ProtocolError
from prima.forward.loader import load_model
from prima.model.byte_ranges import ByteRange, normalize
from prima.net import codec, fetch
from prima.net.codec import Activation
from prima.net.limits import DaemonLimits, check_address
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.server import start_server
from prima.net.status import PermissionDeniedError
from prima.plan import plan_from_window_sizes

N_MESSAGES = 2500
SEED = 12
BOUNDS = DaemonLimits(max_sessions=4, max_kv_bytes=64 << 20, max_queued_tokens=16)
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
PROMPT = [1, 504, 3458, 282, 4649, 314]
# The served model's fingerprint and size, set once the daemon is up (the fetch messages use them).
FINGERPRINT = [""]
FILE_SIZE = [1]


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


# -- random messages ------------------------------------------------------------------------------
def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.2:
        return ""
    if kind < 0.3:
        return "s" * rng.choice([129, 4096, 200_000])
    if kind < 0.4:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(1, 20)))
    return rng.choice(["s1", "solo", "head", "unix:/tmp/x", "127.0.0.1:1", "x:99999", "[::1]:0"])


def _int(rng: random.Random, bits: int) -> int:
    return rng.choice([0, 1, 2, 5, 7, 30, 31, 512, 8192, (1 << bits) - 1, rng.randrange(1 << bits)])


def _plan(rng: random.Random, port: int) -> pb.Plan:
    nodes = [("solo", f"127.0.0.1:{port}")] + [(_text(rng), _text(rng)) for _ in range(rng.randrange(0, 2))]
    msg = pb.Plan(n_layers=_int(rng, 32), rounds=_int(rng, 32), epoch=_int(rng, 64))
    for node_id, address in nodes:
        windows = [pb.Window(start=_int(rng, 32), end=_int(rng, 32)) for _ in range(rng.randrange(0, 3))]
        msg.nodes.append(pb.NodeAssignment(node_id=node_id, address=address, windows=windows))
    return msg


def _activation(rng: random.Random) -> pb.Activation:
    n = rng.choice([0, 1, 2, 9])
    act = Activation(_text(rng), _int(rng, 64), 0, np.arange(n), np.zeros((n, 576), np.float32))
    msg = codec.encode_activation(act) if n else pb.Activation(session_id=act.session_id)
    msg.hop_index = _int(rng, 32)
    if rng.random() < 0.5:
        msg.hidden.dtype = _int(rng, 8)  # type: ignore[assignment]
    if rng.random() < 0.3:
        msg.hidden.data = msg.hidden.data[: rng.randrange(len(msg.hidden.data) + 1)]
    if rng.random() < 0.3:
        del msg.positions[:]
        msg.positions.extend(rng.choice([-1, 0, 1 << 40]) for _ in range(n))
    return msg


def _should_fail(rpc: str, msg: object) -> bool:
    """Messages the protocol forbids, whatever the daemon's state: OK for them would be silent."""
    if rpc in ("OpenSession", "CloseSession", "Abort"):
        sid = msg.session_id  # type: ignore[attr-defined]
        if not sid or len(sid.encode()) > 128 or not sid.isprintable():
            return True
    if rpc == "OpenSession":
        return msg.n_ctx == 0  # type: ignore[attr-defined]
    if rpc == "LoadPlan":
        return msg.wire_dtype > 4 or msg.plan.epoch == 0  # type: ignore[attr-defined]
    if rpc == "FetchRanges":
        spans = msg.ranges  # type: ignore[attr-defined]
        return (
            msg.model_fingerprint != FINGERPRINT[0]  # type: ignore[attr-defined]
            or not spans
            or len(spans) > fetch.MAX_RANGES
            or any(not s.start < s.end <= FILE_SIZE[0] for s in spans)
        )
    return rpc == "Generate" and not msg.prompt_ids  # type: ignore[attr-defined]


def _message(rng: random.Random, rpc: str, port: int) -> object:
    if rpc == "LoadPlan":
        return pb.LoadPlanRequest(plan=_plan(rng, port), node_id=_text(rng), wire_dtype=_int(rng, 3))  # type: ignore[arg-type]
    if rpc == "OpenSession":
        return pb.OpenSessionRequest(session_id=_text(rng), plan_epoch=_int(rng, 64), n_ctx=_int(rng, 32))
    if rpc == "CloseSession":
        return pb.CloseSessionRequest(session_id=_text(rng))
    if rpc == "Abort":
        return pb.AbortRequest(session_id=_text(rng), node_id=_text(rng), message=_text(rng))
    if rpc == "Generate":
        ids = [rng.choice([0, 1, 49151, 49152, 1 << 31]) for _ in range(rng.randrange(0, 4))]
        return pb.GenerateRequest(
            prompt_ids=ids, max_tokens=rng.randrange(0, 2), n_ctx=_int(rng, 16), ubatch=_int(rng, 16)
        )
    if rpc == "Profile":
        return pb.ProfileRequest(peer_address=rng.choice(["unix:/tmp/x", "nope", "x:0", "a/b:1", ":5"]))
    if rpc == "Ping":
        return pb.PingRequest(payload=bytes(rng.randrange(0, 64)))
    if rpc == "FetchRanges":
        return _fetch_request(rng)
    if rpc == "Manifest":
        return pb.ManifestRequest()
    return pb.InfoRequest()


def _fetch_request(rng: random.Random) -> pb.FetchRequest:
    """Mostly small ranges of the file (so an answer stays small), some past its end, empty,
    reversed, or far too many; the right fingerprint or garbage."""
    size = FILE_SIZE[0]
    spans = []
    for _ in range(rng.choice([0, 1, 2, 3])):
        start = rng.choice([0, rng.randrange(size), size - 1, size, 1 << 63])
        spans.append(pb.ByteSpan(start=start, end=max(0, start + rng.choice([-1, 0, 1, 4096, 70_000]))))
    if rng.random() < 0.02:
        spans = [pb.ByteSpan(start=0, end=1)] * (fetch.MAX_RANGES + 1)
    fingerprint = FINGERPRINT[0] if rng.random() < 0.7 else _text(rng)
    return pb.FetchRequest(
        model_fingerprint=fingerprint, ranges=[s for s in spans if s.end < 1 << 64], piece_bytes=_int(rng, 32)
    )


def _send(stub: pb_grpc.NodeStub, rpc: str, msg: object) -> grpc.StatusCode:
    calls: dict[str, Callable[[], object]] = {
        "Relay": lambda: stub.Relay(iter(msg if isinstance(msg, list) else [msg]), timeout=30),
        "Generate": lambda: list(stub.Generate(msg, timeout=30)),
        "FetchRanges": lambda: _check_pieces(msg, list(stub.FetchRanges(msg, timeout=30))),  # type: ignore[arg-type]
    }
    try:
        calls.get(rpc, lambda: getattr(stub, rpc)(msg, timeout=30))()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _check_pieces(request: pb.FetchRequest, replies: list[pb.FilePiece]) -> None:
    """An answered fetch: exactly the bytes asked for, each piece matching its sha256."""
    asked = normalize(ByteRange(s.start, s.end) for s in request.ranges)
    got = [ByteRange(r.offset, r.offset + len(r.data)) for r in replies]
    assert normalize(got) == asked, (asked, got)
    assert all(hashlib.sha256(r.data).hexdigest() == r.sha256 for r in replies)


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
        msg = _activation(rng) if rpc == "Relay" else _message(rng, rpc, port)
        code = _send(stub, rpc, msg)
        seen.add((rpc, code))
        if code in BAD_CODES or (code == grpc.StatusCode.OK and _should_fail(rpc, msg)):
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
        _send(stub, "OpenSession", pb.OpenSessionRequest(session_id=f"spam{i}", plan_epoch=epoch, n_ctx=8192))
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
        target=lambda: flood_codes.extend(_send(stub, "Relay", flood) for _ in range(3))
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
