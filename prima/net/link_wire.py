"""The activation link's bytes: what a node sends a peer on the link, and what it may get back.

A link opens with MAGIC; then every message is a frame: a 5-byte header (payload length,
little-endian u32, then the kind) and the payload. The caller sends ACTIVATION frames: the fields
of a prima.v1.Activation (the message a Relay stream carries, checked the same way) in a fixed
little-endian layout, ACTIVATION_HEADER, then the session id and the hidden rows' bytes as they
are. Not protobuf: every token crosses every hop, on a core just woken with cold caches, where
building and parsing a message is a large part of a hop's own cost (docs/performance.md). The
listener sends at most one frame, an ERROR saying why it is hanging up: a gRPC status name, a
newline, and a message for people. Pure functions: sockets live in link_server and link_client.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from prima.errors import ProtocolError
from prima.net import codec, limits
from prima.net.codec import Activation, WireDType
from prima.net.status import PayloadTooLargeError

MAGIC = b"prima-link/2\n"
HEADER = struct.Struct("<IB")
ACTIVATION = 1
ERROR = 2
KINDS = (ACTIVATION, ERROR)
MAX_ERROR_BYTES = 2000
# An ACTIVATION frame's payload opens with: plan epoch, hop index, batch seq, first position,
# rows, columns, wire dtype, all_rows (0 or 1), session id bytes. The session id (UTF-8) follows,
# then the hidden rows in the wire dtype, then (Q8_BLOCK only) their f16 scales.
ACTIVATION_HEADER = struct.Struct("<QIQqIIBBH")
# The link header and those fields in one: a frame is built with one pack call.
_FRAME_START = struct.Struct(HEADER.format + ACTIVATION_HEADER.format[1:])
_F32 = int(WireDType.F32)
_Q8_BLOCK = int(WireDType.Q8_BLOCK)
_LITTLE_ENDIAN_F32 = np.dtype(np.float32).str == "<f4"


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def error_frame(status_name: str, message: str) -> bytes:
    return frame(ERROR, f"{status_name}\n{message}".encode()[:MAX_ERROR_BYTES])


def activation_frame(act: Activation, dtype: WireDType = WireDType.F32) -> bytes:
    """The whole ACTIVATION frame (link header included) that carries `act` in `dtype`."""
    hidden = act.hidden
    if hidden.dtype != np.float32:
        hidden = hidden.astype(np.float32)
    if hidden.ndim != 2:
        raise ProtocolError(f"hidden states have shape {hidden.shape}; send (n_tokens, d_model)")
    if len(act.positions) != len(hidden):
        raise ProtocolError(f"{len(act.positions)} positions for {len(hidden)} rows of hidden states")
    sid = act.session_id.encode()
    if len(sid) > limits.MAX_SESSION_ID_BYTES:
        raise ProtocolError(
            f"a session id of {len(sid)} bytes is over the {limits.MAX_SESSION_ID_BYTES} a node takes"
        )
    # float32 rows, the ring's default, go as they are on a little-endian CPU (no conversion call)
    fast = dtype == _F32 and _LITTLE_ENDIAN_F32
    data, scales = (hidden.tobytes(), b"") if fast else codec.tensor_bytes(hidden, dtype)
    rows, cols = hidden.shape
    length = ACTIVATION_HEADER.size + len(sid) + len(data) + len(scales)
    start = _FRAME_START.pack(
        length,
        ACTIVATION,
        act.plan_epoch,
        act.hop_index,
        act.batch_seq,
        codec.first_position(act),
        rows,
        cols,
        int(dtype),
        act.all_rows,
        len(sid),
    )
    return b"".join((start, sid, data, scales))


def parse_activation(payload: bytes | bytearray, *, d_model: int, max_tokens: int) -> Activation:
    """The Activation in an ACTIVATION frame's payload, checked as prima.net.codec checks one
    from a Relay stream: ProtocolError (or PayloadTooLargeError) naming what is wrong."""
    if len(payload) < ACTIVATION_HEADER.size:
        raise ProtocolError(
            f"an activation frame of {len(payload)} bytes is shorter than its {ACTIVATION_HEADER.size}-byte header"
        )
    epoch, hop, seq, first, rows, cols, dtype, all_rows, sid_len = ACTIVATION_HEADER.unpack_from(payload)
    at = ACTIVATION_HEADER.size
    try:
        session_id = payload[at : at + sid_len].decode()
    except UnicodeDecodeError:
        raise ProtocolError("an activation's session id is not UTF-8") from None
    codec.check_activation(session_id, (rows, cols), d_model=d_model, max_tokens=max_tokens)
    positions = codec.positions_from(first, rows)
    if all_rows > 1:
        raise ProtocolError(f"all_rows is {all_rows}; it is 0 or 1")
    n = rows * cols
    data_bytes = n * codec.wire_width(dtype)
    scale_bytes = codec.q8_scale_bytes(n) if dtype == _Q8_BLOCK else 0
    at += sid_len
    if len(payload) != at + data_bytes + scale_bytes:
        raise ProtocolError(
            f"an activation of {rows}x{cols} values in {WireDType(dtype).name} with a {sid_len}-byte "
            f"session id is a payload of {at + data_bytes + scale_bytes} bytes, not {len(payload)}"
        )
    if dtype == _F32 and isinstance(payload, bytearray):
        hidden = codec.f32_rows_in(payload, at, (rows, cols))  # the frame's own buffer, no copy
    else:
        view = memoryview(payload)
        hidden = codec.tensor_from_bytes(
            dtype,
            (rows, cols),
            view[at : at + data_bytes],
            view[at + data_bytes : at + data_bytes + scale_bytes],
        )
    return Activation(session_id, epoch, hop, positions, hidden, seq, bool(all_rows))


def parse_error(payload: bytes) -> tuple[str, str]:
    """(status name, message) of an ERROR frame's payload."""
    status, _, message = payload.decode(errors="replace").partition("\n")
    return status[:40], message


def check_magic(opening: bytes) -> None:
    if opening != MAGIC:
        raise ProtocolError(
            f"this is primad's activation link, which opens with {MAGIC!r}, not {opening[:16]!r}; "
            "talk to primad's gRPC port instead"
        )


def read_frame(
    read_exactly: Callable[[int], bytes | bytearray], max_bytes: int
) -> tuple[int, bytes | bytearray] | None:
    """The next (kind, payload), read with `read_exactly(n)` (which returns fewer bytes only at
    the end of the stream); None at a clean end between frames. ProtocolError for a cut frame
    or an unknown kind; PayloadTooLargeError for a payload over `max_bytes`, before reading it."""
    header = read_exactly(HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise ProtocolError("the link ended inside a frame header")
    length, kind = HEADER.unpack(header)
    if kind not in KINDS:
        raise ProtocolError(f"frame of unknown kind {kind}; this node knows {list(KINDS)}")
    if length > max_bytes:
        raise PayloadTooLargeError(
            f"a frame of {length} bytes is over this node's limit of {max_bytes}; send smaller micro-batches"
        )
    payload = read_exactly(length)
    if len(payload) < length:
        raise ProtocolError(f"the link ended {length - len(payload)} bytes short of a frame's end")
    return kind, payload
