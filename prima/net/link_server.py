"""A daemon's activation link: a TLS socket beside its gRPC port that takes the activations a
peer relays to it, the same messages as a Relay stream, checked the same way.

Why a second transport: on a ring every token crosses every hop, and a gRPC stream wakes three
Python threads per message on the receiving side and one more on the sending side, each running
on cold caches after the ring's wait; a frame on this socket takes one wake-up (its reader
thread) and the sender writes it from its compute thread (docs/ring.md, "The activation link";
the numbers in docs/performance.md).
gRPC stays the control plane and the fallback: a peer whose link cannot be reached (an old
primad, a firewall) is relayed to over gRPC.

Each connection gets a thread of its own, which completes the handshake, checks the caller as
the gRPC server would (a certificate of the cluster, not revoked, a node's, a node of the plan),
then hands each activation to the node runtime. Anything wrong ends that connection with one
ERROR frame saying why (prima.net.link_wire); the daemon keeps serving."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import BinaryIO, Protocol

from cryptography import x509

from prima.errors import PrimaError, ProtocolError
from prima.net import link_tls, link_wire
from prima.net.admission import Admission
from prima.net.codec import Activation
from prima.net.credentials import Identity, cert_name
from prima.net.limits import DaemonLimits, received_message_bytes
from prima.net.link_socket import read_exactly_from, shut
from prima.net.revocation import RevocationList
from prima.net.status import StreamTimeoutError, status_details, status_for

log = logging.getLogger("prima.net")

# Connections served at once (a session's predecessors on each of the default 16 sessions, twice
# over); more are closed at once, and their senders relay over gRPC instead.
MAX_LINKS = 64
HANDSHAKE_TIMEOUT_S = 10.0
READ_BUFFER_BYTES = 1 << 16  # more than a TLS record's 16 KiB
ACCEPT_RETRY_S = 0.1


class LinkHandler(Protocol):
    """What the link needs from the node runtime (a subset of prima.net.servicer.NodeHandler)."""

    d_model: int
    max_batch_tokens: int

    def authorize(self, rpc: str, caller: str | None) -> None: ...

    def accept(self, act: Activation) -> None: ...


class LinkServer:
    """Listen on host:port (0: any free port, see `port`) until `close`."""

    def __init__(
        self,
        handler: LinkHandler,
        host: str,
        port: int = 0,
        *,
        identity: Identity | None,
        limits: DaemonLimits | None = None,
        revoked: RevocationList | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        """`max_message_bytes`: the largest frame read (default: what the handler's model needs,
        limits.received_message_bytes)."""
        self.handler = handler
        self.limits = limits or DaemonLimits()
        self.max_message_bytes = max_message_bytes or min(
            64 << 20, received_message_bytes(handler.d_model, handler.max_batch_tokens)
        )
        self._tls = link_tls.server_context(identity) if identity is not None else None
        self._admission = Admission(revoked)
        self._listener = socket.create_server((host.strip("[]"), port), family=_family(host), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="link-accept", daemon=True)
        self._thread.start()
        log.info("activation link listening on %s:%d", host, self.port)

    def close(self) -> None:
        """Stop listening and end every open link."""
        with self._lock:
            self._closed = True
            conns = list(self._open)
        shut(self._listener)
        for conn in conns:
            shut(conn)
        self._thread.join(5.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # Out of file descriptors, say: keep listening, a little later.
                log.warning("activation link: accepting a connection failed (%s)", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            with self._lock:
                if self._closed or len(self._open) >= MAX_LINKS:
                    conn.close()
                    continue
                self._open.add(conn)
            name = f"link-reader-{peer[0]}:{peer[1]}"
            threading.Thread(target=self._serve, args=(conn,), name=name, daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        sock: socket.socket = conn
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self._tls is not None:
                sock = self._tls.wrap_socket(conn, server_side=True)
            self._relay(sock)
        except PrimaError as exc:
            details = status_details(exc)
            log.info("activation link: answering %s: %s", status_for(exc).name, details)
            _send_quietly(sock, link_wire.error_frame(status_for(exc).name, details))
        except (ssl.SSLError, OSError) as exc:
            # No certificate of the cluster, plaintext against TLS, a peer that hung up: nothing
            # reached the node, and there is no one to tell.
            log.info("activation link from %s ended: %s", _peer(conn), exc)
        except Exception as exc:  # a bug must end one link, not the daemon's listener
            log.exception("activation link from %s failed", _peer(conn))
            _send_quietly(sock, link_wire.error_frame("INTERNAL", f"the node failed: {exc}"))
        finally:
            with self._lock:
                self._open.discard(conn)
            shut(sock)

    def _relay(self, sock: socket.socket) -> None:
        """Check the caller, then hand each activation on until the caller hangs up."""
        caller = None
        if self._tls is not None:
            der = sock.getpeercert(binary_form=True)  # type: ignore[attr-defined]
            cert = x509.load_der_x509_certificate(der)
            refused = self._admission.refusal(cert, "Relay")
            if refused is not None:
                code, message = refused
                _send_quietly(sock, link_wire.error_frame(code.name, message))
                return
            caller = cert_name(cert)
        # Buffered, a frame that a peer wrote at once (one TLS record) comes in one read; its
        # header and payload read apart took two, each costing a woken core tens of microseconds.
        with sock.makefile("rb", buffering=READ_BUFFER_BYTES) as stream:
            self._read_activations(stream, sock, caller)

    def _read_activations(self, stream: BinaryIO, sock: socket.socket, caller: str | None) -> None:
        """Read the link's opening, then hand each activation on until the caller hangs up."""

        def read(n: int) -> bytes | bytearray:
            return read_exactly_from(stream, n)

        link_wire.check_magic(read(len(link_wire.MAGIC)))
        h = self.handler
        h.authorize("Relay", caller)
        idle_s, open_s = self.limits.relay_idle_s, self.limits.relay_open_s
        closes_at = time.monotonic() + open_s
        sock.settimeout(idle_s)
        # Looked up once: the loop runs for every token, on a core that has just woken.
        accept, parse, read_frame = h.accept, link_wire.parse_activation, link_wire.read_frame
        d_model, max_tokens, max_bytes = h.d_model, h.max_batch_tokens, self.max_message_bytes
        while True:
            try:
                got = read_frame(read, max_bytes)
            except TimeoutError:
                raise StreamTimeoutError(
                    f"no message on this link for {idle_s:g} s; a node ends idle links (open one per "
                    "session and close it when the session ends)"
                ) from None
            if got is None:
                return
            kind, payload = got
            if kind != link_wire.ACTIVATION:
                raise ProtocolError(f"a caller sends only activations on the link, not frames of kind {kind}")
            if time.monotonic() >= closes_at:
                raise StreamTimeoutError(
                    f"this link has been open {open_s:g} s, the most a node allows; open a new one"
                )
            accept(parse(payload, d_model=d_model, max_tokens=max_tokens))


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.settimeout(2.0)
        sock.sendall(data)
    except (ssl.SSLError, OSError):
        pass


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a caller that left"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
