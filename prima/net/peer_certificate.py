"""The certificate a daemon serves, seen from outside gRPC: gRPC does not show a client its
peer's certificate, so a coordinator that must know it (to check a revocation list, or that an
address found over mDNS belongs to a member before trusting the advert's count) makes one TLS
handshake of its own. TLS 1.3 sends the server's certificate before it asks for the client's,
so no client certificate is needed to see it.
"""

from __future__ import annotations

import socket
import ssl

from cryptography import x509

from prima.errors import UntrustedNodeError
from prima.net.credentials import MEMBER_NAME, node_target_name


def served_certificate(
    address: str, roots_pem: bytes, timeout_s: float, node_id: str | None = None
) -> x509.Certificate:
    """The certificate the daemon at `address` (host:port) serves, verified against `roots_pem`
    and as node `node_id`'s (any node's without one). Any failure, from an unreachable address to
    a stranger's certificate or a TLS version that hides it, is an UntrustedNodeError."""
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=roots_pem.decode("ascii"))
    ctx.set_alpn_protocols(["h2"])
    who = f"node {node_id}" if node_id else "the daemon"
    try:
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock,
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
