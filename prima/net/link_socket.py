"""Socket chores both ends of an activation link share (prima.net.link_server, link_client)."""

from __future__ import annotations

import socket


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes, or fewer only where the peer ended the stream."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            break
        got += k
    return bytes(view[:got])


def shut(sock: socket.socket) -> None:
    """End the connection both ways (waking a thread blocked on it), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
