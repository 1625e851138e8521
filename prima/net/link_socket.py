"""Socket chores both ends of an activation link share (prima.net.link_server, link_client)."""

from __future__ import annotations

import socket
from typing import BinaryIO


def read_exactly(sock: socket.socket, n: int) -> bytes | bytearray:
    """`n` bytes, or fewer only where the peer ended the stream."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            break
        got += k
    return buf if got == n else bytes(view[:got])  # the buffer itself: no copy of a whole frame


def read_exactly_from(stream: BinaryIO, n: int) -> bytes | bytearray:
    """`read_exactly` from a buffered stream over a socket (`socket.makefile`), which reads a
    whole TLS record at a time: a frame written at once comes in one read."""
    buf = bytearray(n)
    got = stream.readinto(buf)  # fills `buf` but where the stream ends
    return buf if got == n else bytes(buf[:got])


def shut(sock: socket.socket) -> None:
    """End the connection both ways (waking a thread blocked on it), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
