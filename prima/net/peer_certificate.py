"""The certificate a daemon serves, seen from outside gRPC: gRPC does not show a client its
peer's certificate, so a coordinator that must know it (to check a revocation list, or that an
address found over mDNS belongs to a member before trusting the advert's count) makes one TLS
handshake of its own. It presents its own certificate as gRPC would: a daemon logs a caller
without one (PEER_DID_NOT_RETURN_A_CERTIFICATE) as the sign of a stranger (docs/security.md),
and the coordinator's own check must not raise that alarm.
"""

from __future__ import annotations

import os
import socket
import ssl
import tempfile
import threading

from cryptography import x509

from prima.errors import NodeError, UntrustedNodeError
from prima.net.credentials import MEMBER_NAME, Identity, node_target_name


def served_certificate(
    address: str,
    roots_pem: bytes,
    timeout_s: float,
    node_id: str | None = None,
    *,
    client: Identity | None = None,
) -> x509.Certificate:
    """The certificate the daemon at `address` (host:port) serves, verified against `roots_pem`
    and as node `node_id`'s (any node's without one), presenting `client`'s certificate if given.
    NodeError if nothing answers at `address` (a dead daemon is not a stranger); any failure of
    the TLS handshake itself, from a stranger's certificate to a TLS version that hides it, is an
    UntrustedNodeError."""
    host, _, port = address.rpartition(":")
    ctx = _context(roots_pem, client)
    who = f"node {node_id}" if node_id else "the daemon"
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        raise NodeError(
            f"{who} at {address} did not answer ({exc}); it is not running, or unreachable"
        ) from None
    try:
        with (
            sock,
            ctx.wrap_socket(
                sock, server_hostname=node_target_name(node_id) if node_id else MEMBER_NAME
            ) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError) as exc:
        raise UntrustedNodeError(
            f"{who} at {address} did not show a node certificate this cluster issued ({exc})"
        ) from None
    if der is None:
        raise UntrustedNodeError(f"{who} at {address} showed no certificate")
    return x509.load_der_x509_certificate(der)


_contexts: dict[tuple[bytes, bytes, bytes], ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def _context(roots_pem: bytes, client: Identity | None) -> ssl.SSLContext:
    """A client context trusting `roots_pem` and presenting `client`'s certificate (made once
    per identity: loading the key means writing it to a private file for a moment)."""
    key = (roots_pem, client.cert_pem if client else b"", client.key_pem if client else b"")
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is not None:
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cadata=roots_pem.decode("ascii"))
        ctx.set_alpn_protocols(["h2"])
        if client is not None:
            # ssl loads keys only from files: one readable by this user alone, removed at once.
            fd, path = tempfile.mkstemp(prefix="prima-probe-", suffix=".pem")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(client.key_pem + client.cert_pem)
                ctx.load_cert_chain(path)
            finally:
                os.unlink(path)
        if len(_contexts) >= 8:
            _contexts.clear()
        _contexts[key] = ctx
        return ctx
