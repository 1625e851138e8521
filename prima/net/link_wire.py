"""The activation link's bytes: what a node sends a peer on the link, and what it may get back.

A link opens with MAGIC; then every message is a frame: a 5-byte header (payload length,
little-endian u32, then the kind) and the payload. The caller sends ACTIVATION frames, each a
serialized prima.v1.Activation (the message a Relay stream carries, checked the same way). The
listener sends at most one frame, an ERROR saying why it is hanging up: a gRPC status name, a
newline, and a message for people. Pure functions: sockets live in link_server and link_client.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from prima.errors import ProtocolError
from prima.net.status import PayloadTooLargeError

MAGIC = b"prima-link/1\n"
HEADER = struct.Struct("<IB")
ACTIVATION = 1
ERROR = 2
KINDS = (ACTIVATION, ERROR)
MAX_ERROR_BYTES = 2000


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def error_frame(status_name: str, message: str) -> bytes:
    return frame(ERROR, f"{status_name}\n{message}".encode()[:MAX_ERROR_BYTES])


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


def read_frame(read_exactly: Callable[[int], bytes], max_bytes: int) -> tuple[int, bytes] | None:
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
