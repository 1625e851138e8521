"""The only place numpy arrays and plans become protobuf messages and back.

Pure functions over frozen dataclasses. Decoding trusts nothing: every size is checked against
the declared shape and the caller's limits before numpy touches the bytes, and every problem is
a ProtocolError (or a subclass from prima.net.status) naming what was wrong.

Wire dtypes: f32 is bit-exact; f16 and bf16 halve the bytes; Q8_BLOCK (32 int8 values sharing
one f16 scale, 34 bytes per 32 values) quarters them for slow links at ~0.4% relative error.
"""

from __future__ import annotations

import enum
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from prima.engine.generate import GenerateRequest, GenerationDone, TokenEvent
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DEFAULT_DRAFT_MAX, DraftConfig
from prima.errors import InputError, PlanError, ProtocolError
from prima.net.proto import prima_pb2 as pb
from prima.net.status import PayloadTooLargeError
from prima.plan import NodeAssignment, Plan, Window
from prima.scheduler.profile_schema import DeviceProfile

PROTOCOL_VERSION = 4
Q8_BLOCK = 32
MAX_TENSOR_BYTES = 256 << 20  # hard ceiling whatever the caller allows
MAX_SHOWN_CHARS = 500  # of a peer's free text kept for messages to people
MAX_POSITION = 1 << 62  # far past any context, and within int64 whatever is added to it
_LITTLE_ENDIAN = sys.byteorder == "little"


class WireDType(enum.IntEnum):
    """Activation encodings; values equal the proto enum `prima.v1.DType`."""

    F32 = pb.DTYPE_F32
    F16 = pb.DTYPE_F16
    BF16 = pb.DTYPE_BF16
    Q8_BLOCK = pb.DTYPE_Q8_BLOCK

    @classmethod
    def parse(cls, name: str) -> WireDType:
        try:
            return cls[name.upper().replace("-", "_")]
        except KeyError:
            raise ProtocolError(
                f"unknown wire dtype {name!r}; use one of {[d.name.lower() for d in cls]}"
            ) from None


# -- tensors -------------------------------------------------------------------------------------
def encode_tensor(x: np.ndarray, dtype: WireDType = WireDType.F32) -> pb.Tensor:
    """A float array as a Tensor message in `dtype`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    data, scales = tensor_bytes(x, dtype)
    msg = pb.Tensor(dtype=int(dtype), shape=list(x.shape), data=data)
    if scales:
        msg.scales = scales
    return msg


def tensor_bytes(x: np.ndarray, dtype: WireDType) -> tuple[bytes, bytes]:
    """(data, scales) of float32 array `x` in `dtype`; scales are empty but for Q8_BLOCK."""
    if dtype == WireDType.F32:
        return (x if x.dtype.str == "<f4" else x.astype("<f4")).tobytes(), b""
    if dtype == WireDType.F16:
        return x.astype("<f2").tobytes(), b""
    if dtype == WireDType.BF16:
        bits = x.view(np.uint32).astype(np.uint64)
        # Round to nearest even on the 16 bits dropped.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype("<u2").tobytes(), b""
    if dtype == WireDType.Q8_BLOCK:
        q, scales = _q8_quantize(x.reshape(-1))
        return q.tobytes(), scales.tobytes()
    raise ProtocolError(f"cannot encode dtype {dtype!r}")


# Bytes per value on the wire, by the proto's dtype number: one dict look-up per tensor, on the
# path every activation takes (see decode_activation).
_WIDTHS = {int(WireDType.F32): 4, int(WireDType.F16): 2, int(WireDType.BF16): 2, int(WireDType.Q8_BLOCK): 1}


def decode_tensor(msg: pb.Tensor, *, max_bytes: int = MAX_TENSOR_BYTES) -> np.ndarray:
    """A Tensor message as a float32 array, after checking its dtype, shape and byte counts."""
    shape = tuple(msg.shape)
    if not shape:
        raise ProtocolError("tensor has no shape; send at least one dimension")
    n = math.prod(shape)
    if n * 4 > min(max_bytes, MAX_TENSOR_BYTES):
        raise PayloadTooLargeError(
            f"tensor of shape {shape} needs {n * 4} bytes as f32, over this node's limit of "
            f"{min(max_bytes, MAX_TENSOR_BYTES)}; send smaller micro-batches"
        )
    width = wire_width(msg.dtype)
    if len(msg.data) != n * width:
        raise ProtocolError(
            f"tensor of shape {shape} in {WireDType(msg.dtype).name} needs {n * width} data bytes, "
            f"got {len(msg.data)}"
        )
    if msg.dtype == WireDType.Q8_BLOCK and len(msg.scales) != q8_scale_bytes(n):
        raise ProtocolError(
            f"Q8_BLOCK tensor of {n} values needs {q8_scale_bytes(n) // 2} f16 scales, got {len(msg.scales) // 2}"
        )
    return tensor_from_bytes(msg.dtype, shape, msg.data, msg.scales)


def wire_width(dtype: int) -> int:
    """Bytes per value of wire dtype number `dtype`; ProtocolError for a number not known here."""
    width = _WIDTHS.get(dtype)
    if width is None:
        raise ProtocolError(f"unknown tensor dtype {dtype}; this node speaks {[d.name for d in WireDType]}")
    return width


def q8_scale_bytes(n: int) -> int:
    """Bytes of f16 scales that `n` values in Q8_BLOCK carry."""
    return -(-n // Q8_BLOCK) * 2


def tensor_from_bytes(
    dtype: int, shape: tuple[int, ...], data: bytes | memoryview, scales: bytes | memoryview = b""
) -> np.ndarray:
    """A new float32 array of `shape` from its wire bytes, whose lengths the caller has checked
    (`wire_width`, `q8_scale_bytes`)."""
    if dtype == WireDType.F32:
        if _LITTLE_ENDIAN:  # one copy, into memory the array owns and may write
            return np.ndarray(shape, np.float32, bytearray(data))
        return np.frombuffer(data, dtype="<f4").reshape(shape).astype(np.float32)
    if dtype == WireDType.F16:
        return np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(shape)
    if dtype == WireDType.BF16:
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    n = math.prod(shape)
    q = np.frombuffer(data, dtype=np.int8)
    return _q8_dequantize(q, np.frombuffer(scales, dtype="<f2"), n).reshape(shape)


def f32_rows_in(buffer: bytearray, offset: int, shape: tuple[int, int]) -> np.ndarray:
    """Little-endian float32 rows of `shape` at `offset` of `buffer`, as an array over the
    buffer itself where this CPU can use them in place (little-endian, 4-byte aligned), else a
    copy: a link frame's rows need no second copy and no second numpy call."""
    if _LITTLE_ENDIAN and offset % 4 == 0:
        return np.ndarray(shape, np.float32, buffer, offset)
    return tensor_from_bytes(WireDType.F32, shape, memoryview(buffer)[offset : offset + 4 * math.prod(shape)])


def _q8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block of 32: scale = max|x| / 127 (f16), q = round(x / scale) as int8."""
    n = x.size
    blocks = np.zeros(-(-n // Q8_BLOCK) * Q8_BLOCK, dtype=np.float32)
    blocks[:n] = x
    blocks = blocks.reshape(-1, Q8_BLOCK)
    scales = (np.abs(blocks).max(axis=1) / 127.0).astype("<f2")
    inv = np.divide(1.0, scales.astype(np.float32), out=np.zeros(len(scales), np.float32), where=scales > 0)
    q = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int8)
    return q.reshape(-1)[:n], scales


def _q8_dequantize(q: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    padded = np.zeros(len(scales) * Q8_BLOCK, dtype=np.float32)
    padded[:n] = q
    return (padded.reshape(-1, Q8_BLOCK) * scales.astype(np.float32)[:, None]).reshape(-1)[:n]


# -- activations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Activation:
    """Hidden states (n, d_model) of tokens at `positions`, due to compute hop `hop_index` next.
    `all_rows`: the head needs every row back (draft checks), not only the last (prefill)."""

    session_id: str
    plan_epoch: int
    hop_index: int
    positions: np.ndarray
    hidden: np.ndarray
    batch_seq: int = 0
    all_rows: bool = False  # back at the head with every row, not only the last (embeddings)


def encode_activation(act: Activation, dtype: WireDType = WireDType.F32) -> pb.Activation:
    return pb.Activation(
        session_id=act.session_id,
        plan_epoch=act.plan_epoch,
        hop_index=act.hop_index,
        positions=[int(p) for p in act.positions],
        hidden=encode_tensor(act.hidden, dtype),
        batch_seq=act.batch_seq,
        all_rows=act.all_rows,
    )


def decode_activation(msg: pb.Activation, *, d_model: int, max_tokens: int) -> Activation:
    """Check an Activation's shape against this model and the node's batch limit, then decode."""
    shape = tuple(msg.hidden.shape)
    check_activation(msg.session_id, shape, d_model=d_model, max_tokens=max_tokens)
    if len(msg.positions) != shape[0]:
        raise ProtocolError(f"{len(msg.positions)} positions for {shape[0]} rows of hidden states")
    # Checked in Python, not numpy: every hop of every token decodes here, often on a core that
    # has just woken with cold caches, where each numpy call costs tens of microseconds.
    first = msg.positions[0]
    if shape[0] > 1 and list(msg.positions) != list(range(first, first + shape[0])):
        raise ProtocolError("positions must be consecutive and non-negative")
    positions = positions_from(first, shape[0])
    hidden = decode_tensor(msg.hidden, max_bytes=max_tokens * d_model * 4)
    return Activation(
        msg.session_id, msg.plan_epoch, msg.hop_index, positions, hidden, msg.batch_seq, msg.all_rows
    )


def check_activation(session_id: str, shape: tuple[int, ...], *, d_model: int, max_tokens: int) -> None:
    """ProtocolError (PayloadTooLargeError) unless an activation of `session_id` with hidden
    states of `shape` is one this node can take: (n_tokens, d_model), 1 <= n_tokens <= max_tokens."""
    if not session_id:
        raise ProtocolError("activation has no session_id; open a session first")
    if len(shape) != 2 or shape[1] != d_model:
        raise ProtocolError(f"hidden states have shape {shape}; this model needs (n_tokens, {d_model})")
    if shape[0] == 0:
        raise ProtocolError("hidden states have no rows; send at least one token")
    if shape[0] > max_tokens:
        raise PayloadTooLargeError(
            f"micro-batch of {shape[0]} tokens exceeds this node's limit of {max_tokens}; split the prompt"
        )


def positions_from(first: int, n: int) -> np.ndarray:
    """Positions first, first + 1, ... of `n` rows, checked to be non-negative int64s."""
    if first < 0 or first + n > MAX_POSITION:
        raise ProtocolError("positions must be consecutive and non-negative")
    return np.arange(first, first + n, dtype=np.int64)


def first_position(act: Activation) -> int:
    """The position of `act`'s first row, after checking that its positions run on by one from
    there, as every activation's must (a ProtocolError otherwise: the sender's bug)."""
    n = len(act.positions)
    first = int(act.positions[0])
    if first < 0 or (n > 1 and not np.array_equal(act.positions, np.arange(first, first + n))):
        raise ProtocolError("positions must be consecutive and non-negative")
    return first


# -- plans ---------------------------------------------------------------------------------------
def plan_to_proto(plan: Plan) -> pb.Plan:
    return pb.Plan(
        n_layers=plan.n_layers,
        rounds=plan.rounds,
        epoch=plan.epoch,
        nodes=[
            pb.NodeAssignment(
                node_id=n.node_id,
                address=n.address,
                windows=[pb.Window(start=w.start, end=w.end) for w in n.windows],
                accel_layers=n.accel_layers,
            )
            for n in plan.nodes
        ],
    )


def plan_from_proto(msg: pb.Plan) -> Plan:
    """A validated Plan; a plan that does not tile the model is a ProtocolError."""
    try:
        return Plan(
            n_layers=msg.n_layers,
            rounds=msg.rounds,
            epoch=msg.epoch,
            nodes=tuple(
                NodeAssignment(
                    n.node_id, n.address, tuple(Window(w.start, w.end) for w in n.windows), n.accel_layers
                )
                for n in msg.nodes
            ),
        )
    except PlanError as exc:
        raise ProtocolError(f"invalid plan: {exc}") from exc


# -- device profiles -----------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeProfile:
    """A node's answer to the Profile RPC: its hardware (with the link to the peer it was asked
    about, if any), its --mem-budget, and when its speeds were measured."""

    device: DeviceProfile
    mem_budget_bytes: int = 0
    measured_unix_s: float = 0.0


def node_profile_to_proto(p: NodeProfile) -> pb.ProfileReply:
    return pb.ProfileReply(
        device_profile_json=json.dumps(p.device.to_dict()),
        mem_budget_bytes=p.mem_budget_bytes,
        measured_unix_s=p.measured_unix_s,
    )


def node_profile_from_proto(msg: pb.ProfileReply) -> NodeProfile:
    """Decode a peer's profile; ProtocolError naming the problem if it is not a valid one."""
    try:
        raw = json.loads(msg.device_profile_json)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"device profile is not JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ProtocolError("device profile is not a JSON object")
    try:
        device = DeviceProfile.from_dict(raw)
    except InputError as exc:
        raise ProtocolError(str(exc)) from None
    return NodeProfile(device, int(msg.mem_budget_bytes), float(msg.measured_unix_s))


# -- sampling ------------------------------------------------------------------------------------
def sampler_to_proto(cfg: SamplerConfig) -> pb.SamplerSettings:
    return pb.SamplerSettings(
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p,
        repeat_penalty=cfg.repeat_penalty,
        repeat_last_n=cfg.repeat_last_n,
        has_seed=cfg.seed is not None,
        seed=cfg.seed or 0,
    )


def sampler_from_proto(msg: pb.SamplerSettings) -> SamplerConfig:
    return SamplerConfig(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        repeat_penalty=msg.repeat_penalty,
        repeat_last_n=msg.repeat_last_n,
        seed=msg.seed if msg.has_seed else None,
    )


def generate_request_to_proto(req: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_ids=list(req.prompt_ids),
        max_tokens=req.max_tokens,
        sampler=sampler_to_proto(req.sampler),
        stop_ids=list(req.stop_ids),
        n_ctx=req.n_ctx,
        ubatch=req.ubatch,
        want_prompt_logits=req.want_prompt_logits,
        first_step=req.first_step,
        draft=req.draft.method,
        draft_max=req.draft.max_tokens,
        want_hidden_states=req.want_hidden_states,
        draft_model=req.draft.model_fingerprint,
        keep_session=req.keep_session,
    )


def generate_request_from_proto(msg: pb.GenerateRequest, *, vocab_size: int) -> GenerateRequest:
    """The request a coordinator sent, checked against the model (InputError says what is off)."""
    bad = [t for t in [*msg.prompt_ids, *msg.stop_ids] if t >= vocab_size]
    if bad:
        raise InputError(f"token ids {bad[:5]} are outside the model's vocabulary of {vocab_size}")
    return GenerateRequest(
        prompt_ids=tuple(msg.prompt_ids),
        max_tokens=msg.max_tokens,
        sampler=sampler_from_proto(msg.sampler),
        stop_ids=tuple(msg.stop_ids),
        n_ctx=msg.n_ctx or 2048,
        ubatch=msg.ubatch,
        want_prompt_logits=msg.want_prompt_logits,
        first_step=msg.first_step,
        draft=DraftConfig(msg.draft or "none", msg.draft_max or DEFAULT_DRAFT_MAX, msg.draft_model),
        want_hidden_states=msg.want_hidden_states,
        keep_session=msg.keep_session,
    )


def token_event_to_proto(event: TokenEvent) -> pb.GenerateReply:
    if not isinstance(event, GenerationDone):
        return pb.GenerateReply(token_id=int(event))
    reply = pb.GenerateReply(
        done=True,
        stop_reason=event.stop_reason,
        prompt_ms=event.prompt_ms,
        generate_ms=event.generate_ms,
        draft_tokens=event.draft_tokens,
        accepted_tokens=event.accepted_tokens,
        cached_tokens=event.cached_tokens,
    )
    if event.prompt_logits is not None:
        reply.prompt_logits.CopyFrom(encode_tensor(np.asarray(event.prompt_logits, dtype=np.float32)))
    if event.hidden_states is not None:
        reply.hidden_states.CopyFrom(encode_tensor(np.asarray(event.hidden_states, dtype=np.float32)))
    return reply


def token_event_from_proto(msg: pb.GenerateReply) -> TokenEvent:
    if not msg.done:
        return int(msg.token_id)
    logits = decode_tensor(msg.prompt_logits) if msg.HasField("prompt_logits") else None
    hidden = decode_tensor(msg.hidden_states) if msg.HasField("hidden_states") else None
    if hidden is not None and hidden.ndim != 2:
        raise ProtocolError(f"hidden states have shape {hidden.shape}; expected (n_tokens, d_model)")
    return GenerationDone(
        msg.stop_reason,
        msg.prompt_ms,
        msg.generate_ms,
        logits,
        draft_tokens=msg.draft_tokens,
        accepted_tokens=msg.accepted_tokens,
        hidden_states=hidden,
        cached_tokens=msg.cached_tokens,
    )
