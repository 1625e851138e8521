"""Relaying to a peer over its activation link (prima.net.link_server): `send` writes the frame
from the calling thread (a node's compute thread), so no other thread wakes to send it.

A watcher thread waits, without touching TLS, for the socket to become readable: the listener
writes only when it is hanging up, with an ERROR frame saying why. The watcher then takes the
send lock (a TLS connection must not read and write from two threads at once), reads that
frame and reports it to `on_error` once, as a gRPC Relay stream's failure is reported."""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable

from prima.errors import NodeError
from prima.net import link_tls, link_wire
from prima.net.codec import Activation, WireDType
from prima.net.credentials import Identity
from prima.net.link_socket import read_exactly, shut

log = logging.getLogger("prima.net")

CONNECT_TIMEOUT_S = 2.0  # a peer whose link does not answer by then is relayed to over gRPC
SEND_TIMEOUT_S = 30.0  # a peer that stops reading for this long has failed
ERROR_READ_TIMEOUT_S = 2.0


def open_link(
    host: str, port: int, identity: Identity | None, node_id: str | None, timeout_s: float = CONNECT_TIMEOUT_S
) -> socket.socket:
    """A connected link to host:port, after the TLS handshake (with `identity`; plaintext
    without) that proves the peer holds `node_id`'s certificate (any member's if None).
    OSError or ssl.SSLError if that cannot be had."""
    raw = socket.create_connection((host.strip("[]"), port), timeout=timeout_s)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        if identity is not None:
            sock = link_tls.client_context(identity).wrap_socket(
                raw, server_hostname=link_tls.target_name(node_id)
            )
        sock.settimeout(SEND_TIMEOUT_S)
        sock.sendall(link_wire.MAGIC)
        return sock
    except BaseException:
        raw.close()
        raise


class LinkRelay:
    """One session's activations to one peer over its link: the same `send` and `close` as
    prima.net.client.RelayStream."""

    transport = "link"

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        address: str,
        on_error: Callable[[NodeError], None],
        wire_dtype: WireDType = WireDType.F32,
    ) -> None:
        self.name = name
        self.address = address
        self.wire_dtype = wire_dtype
        self.error: NodeError | None = None
        self._sock = sock
        self._on_error = on_error
        self._lock = threading.Lock()
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name=f"link-watch-{name}", daemon=True)
        self._watcher.start()

    def send(self, act: Activation) -> None:
        if self.error is not None:
            raise self.error
        data = link_wire.activation_frame(act, self.wire_dtype)
        with self._lock:
            if self.error is not None:
                raise self.error
            try:
                self._sock.sendall(data)
            except (ssl.SSLError, OSError) as exc:
                # Raised to the caller, which reports it (on_error is for failures it cannot see).
                self.error = NodeError(
                    f"node {self.name} at {self.address}: the activation link failed ({exc})"
                )
                raise self.error from None

    def close(self) -> None:
        """End the link (the peer sees a clean end between frames)."""
        with self._lock:
            self._closed = True
            shut(self._sock)

    def _watch(self) -> None:
        try:
            select.select([self._sock], [], [])
        except (OSError, ValueError):  # closed under us
            return
        with self._lock:
            if self._closed:
                return
            error = self._hang_up_reason()
            shut(self._sock)
            if self.error is not None:  # a send saw the failure first, and its caller reports it
                return
            self.error = error
        # Outside the lock: reporting may call the head (an Abort), which can take seconds.
        self._on_error(error)

    def _hang_up_reason(self) -> NodeError:
        """What the peer said as it hung up (called with the send lock held)."""
        try:
            self._sock.settimeout(ERROR_READ_TIMEOUT_S)
            got = link_wire.read_frame(lambda n: read_exactly(self._sock, n), link_wire.MAX_ERROR_BYTES)
        except Exception as exc:  # whatever went wrong, the link is gone
            return NodeError(f"node {self.name} at {self.address} ended the activation link ({exc})")
        if got is None or got[0] != link_wire.ERROR:
            return NodeError(
                f"node {self.name} at {self.address} closed the activation link; check that its primad "
                "is still running"
            )
        status, message = link_wire.parse_error(got[1])
        log.debug("link to %s ended with %s", self.name, status)
        return NodeError(f"Relay on node {self.name} at {self.address} failed: {message}")
