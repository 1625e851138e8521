"""TLS for the activation link (prima.net.link_server, prima.net.link_client), made from the
same cluster identity as a daemon's gRPC credentials: mutual TLS 1.3 with the cluster's CA as
the only root, and on the calling side the same check of who answers (the peer must hold the
certificate of the node it is expected to be, prima.net.credentials.node_target_name).

Python's ssl module reads a private key only from a file, so the key is written to a private
temporary directory for the moment it takes to read it."""

from __future__ import annotations

import functools
import os
import ssl
import tempfile
from pathlib import Path

from prima.net.credentials import MEMBER_NAME, Identity, node_target_name


def _load(ctx: ssl.SSLContext, identity: Identity) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=identity.roots_pem.decode("ascii"))
    with tempfile.TemporaryDirectory(prefix="prima-link-") as directory:  # mode 0700
        path = Path(directory) / "identity.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.key_pem + identity.cert_pem)
        ctx.load_cert_chain(path)


@functools.lru_cache(maxsize=8)
def server_context(identity: Identity) -> ssl.SSLContext:
    """What a daemon's link listener wraps each connection in: a caller must present a
    certificate of the cluster."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load(ctx, identity)
    # After the handshake the listener sends nothing but an error before it hangs up, which is
    # what the caller's watcher waits for (prima.net.link_client); no session tickets.
    ctx.num_tickets = 0
    return ctx


@functools.lru_cache(maxsize=8)
def client_context(identity: Identity) -> ssl.SSLContext:
    """What a node calls a peer's link with (host names checked: see `target_name`)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _load(ctx, identity)
    return ctx


def target_name(node_id: str | None) -> str:
    """The name the peer's certificate must carry: that node's, or any member's when unknown."""
    return node_target_name(node_id) if node_id else MEMBER_NAME
