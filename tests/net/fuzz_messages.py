"""Seeded random and mutated messages for every RPC of a daemon, the statuses they may get, and
sending them: shared by the in-process fuzz test (test_fuzz.py) and the member fuzz of a daemon
process over mutual TLS (member_fuzz.py)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable

import grpc
import numpy as np

from prima.model.byte_ranges import ByteRange, normalize
from prima.net import codec, fetch
from prima.net.codec import Activation
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc

BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# The served model's fingerprint and size, set once the daemon is up (the fetch messages use them).
FINGERPRINT = [""]
FILE_SIZE = [1]


def text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.2:
        return ""
    if kind < 0.3:
        return "s" * rng.choice([129, 4096, 200_000])
    if kind < 0.4:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(1, 20)))
    return rng.choice(["s1", "solo", "head", "unix:/tmp/x", "127.0.0.1:1", "x:99999", "[::1]:0"])


def number(rng: random.Random, bits: int) -> int:
    return rng.choice([0, 1, 2, 5, 7, 30, 31, 512, 8192, (1 << bits) - 1, rng.randrange(1 << bits)])


def plan(rng: random.Random, port: int) -> pb.Plan:
    nodes = [("solo", f"127.0.0.1:{port}")] + [(text(rng), text(rng)) for _ in range(rng.randrange(0, 2))]
    msg = pb.Plan(n_layers=number(rng, 32), rounds=number(rng, 32), epoch=number(rng, 64))
    for node_id, address in nodes:
        windows = [pb.Window(start=number(rng, 32), end=number(rng, 32)) for _ in range(rng.randrange(0, 3))]
        msg.nodes.append(pb.NodeAssignment(node_id=node_id, address=address, windows=windows))
    return msg


def activation(rng: random.Random) -> pb.Activation:
    n = rng.choice([0, 1, 2, 9])
    act = Activation(text(rng), number(rng, 64), 0, np.arange(n), np.zeros((n, 576), np.float32))
    msg = codec.encode_activation(act) if n else pb.Activation(session_id=act.session_id)
    msg.hop_index = number(rng, 32)
    if rng.random() < 0.5:
        msg.hidden.dtype = number(rng, 8)  # type: ignore[assignment]
    if rng.random() < 0.3:
        msg.hidden.data = msg.hidden.data[: rng.randrange(len(msg.hidden.data) + 1)]
    if rng.random() < 0.3:
        del msg.positions[:]
        msg.positions.extend(rng.choice([-1, 0, 1 << 40]) for _ in range(n))
    return msg


def _real(rng: random.Random) -> float:
    return rng.choice([0.0, -1.0, 0.5, 1.0, 2.0, 1e308, 5e-324, 1e-310, math.nan, math.inf, -math.inf])


def sampler(rng: random.Random) -> pb.SamplerSettings:
    """Sampler settings with edge values: negative, subnormal, huge, NaN, infinite."""
    return pb.SamplerSettings(
        temperature=_real(rng),
        top_k=number(rng, 32),
        top_p=_real(rng),
        min_p=_real(rng),
        repeat_penalty=_real(rng),
        has_seed=rng.random() < 0.5,
        seed=number(rng, 64),
        repeat_last_n=number(rng, 32),
    )


def should_fail(rpc: str, msg: object) -> bool:
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


def message(rng: random.Random, rpc: str, port: int) -> object:
    if rpc == "LoadPlan":
        return pb.LoadPlanRequest(plan=plan(rng, port), node_id=text(rng), wire_dtype=number(rng, 3))  # type: ignore[arg-type]
    if rpc == "OpenSession":
        return pb.OpenSessionRequest(session_id=text(rng), plan_epoch=number(rng, 64), n_ctx=number(rng, 32))
    if rpc == "CloseSession":
        return pb.CloseSessionRequest(session_id=text(rng))
    if rpc == "Abort":
        return pb.AbortRequest(session_id=text(rng), node_id=text(rng), message=text(rng))
    if rpc == "Generate":
        ids = [rng.choice([0, 1, 49151, 49152, 1 << 31]) for _ in range(rng.randrange(0, 4))]
        req = pb.GenerateRequest(
            prompt_ids=ids, max_tokens=rng.randrange(0, 2), n_ctx=number(rng, 16), ubatch=number(rng, 16)
        )
        if rng.random() < 0.5:
            req.sampler.CopyFrom(sampler(rng))
        if rng.random() < 0.2:
            req.draft = rng.choice(["lookup", "model", "none", text(rng)])
            req.draft_max = number(rng, 32)
            req.draft_model = text(rng)
        return req
    if rpc == "Profile":
        return pb.ProfileRequest(peer_address=rng.choice(["unix:/tmp/x", "nope", "x:0", "a/b:1", ":5"]))
    if rpc == "Ping":
        return pb.PingRequest(payload=bytes(rng.randrange(0, 64)))
    if rpc == "FetchRanges":
        return fetch_request(rng)
    if rpc == "Manifest":
        return pb.ManifestRequest()
    return pb.InfoRequest()


def fetch_request(rng: random.Random) -> pb.FetchRequest:
    """Mostly small ranges of the file (so an answer stays small), some past its end, empty,
    reversed, or far too many; the right fingerprint or garbage."""
    size = FILE_SIZE[0]
    spans = []
    for _ in range(rng.choice([0, 1, 2, 3])):
        start = rng.choice([0, rng.randrange(size), size - 1, size, 1 << 63])
        spans.append(pb.ByteSpan(start=start, end=max(0, start + rng.choice([-1, 0, 1, 4096, 70_000]))))
    if rng.random() < 0.02:
        spans = [pb.ByteSpan(start=0, end=1)] * (fetch.MAX_RANGES + 1)
    fingerprint = FINGERPRINT[0] if rng.random() < 0.7 else text(rng)
    return pb.FetchRequest(
        model_fingerprint=fingerprint,
        ranges=[s for s in spans if s.end < 1 << 64],
        piece_bytes=number(rng, 32),
    )


def send(stub: pb_grpc.NodeStub, rpc: str, msg: object) -> grpc.StatusCode:
    calls: dict[str, Callable[[], object]] = {
        "Relay": lambda: stub.Relay(iter(msg if isinstance(msg, list) else [msg]), timeout=30),
        "Generate": lambda: list(stub.Generate(msg, timeout=30)),
        "FetchRanges": lambda: check_pieces(msg, list(stub.FetchRanges(msg, timeout=30))),  # type: ignore[arg-type]
    }
    try:
        calls.get(rpc, lambda: getattr(stub, rpc)(msg, timeout=30))()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def check_pieces(request: pb.FetchRequest, replies: list[pb.FilePiece]) -> None:
    """An answered fetch: exactly the bytes asked for, each piece matching its sha256."""
    asked = normalize(ByteRange(s.start, s.end) for s in request.ranges)
    got = [ByteRange(r.offset, r.offset + len(r.data)) for r in replies]
    assert normalize(got) == asked, (asked, got)
    assert all(hashlib.sha256(r.data).hexdigest() == r.sha256 for r in replies)
