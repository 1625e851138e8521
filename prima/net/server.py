"""Start a gRPC server for a node handler on host:port (port 0 picks a free one)."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from prima.errors import NodeError
from prima.net.admission import Admission
from prima.net.client import MAX_MESSAGE_BYTES
from prima.net.credentials import Identity, server_credentials
from prima.net.limits import DaemonLimits
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.revocation import RevocationList
from prima.net.servicer import NodeHandler, NodeServicer

log = logging.getLogger("prima.net")

# Each open Relay or Forward stream holds a thread for the session's lifetime.
MAX_WORKERS = 32


def start_server(
    handler: NodeHandler,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    identity: Identity | None = None,
    limits: DaemonLimits | None = None,
    revoked: RevocationList | None = None,
) -> tuple[grpc.Server, int]:
    """Serve `handler`; return the running server and the port it bound. With `identity`, over
    mutual TLS: a caller without a certificate from the cluster's CA fails the handshake and
    never reaches a handler, and one whose certificate is in `revoked` gets UNAUTHENTICATED.
    Without, plaintext (primad allows that on loopback only)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="primad-rpc"),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ],
        interceptors=[Admission(revoked)] if identity is not None else None,
    )
    pb_grpc.add_NodeServicer_to_server(NodeServicer(handler, limits), server)
    try:
        target = f"{host}:{port}"
        if identity is None:
            bound = server.add_insecure_port(target)
        else:
            bound = server.add_secure_port(target, server_credentials(identity))
    except RuntimeError as exc:
        raise NodeError(f"cannot listen on {host}:{port}: {exc}; pick another --port") from exc
    if bound == 0:
        raise NodeError(f"cannot listen on {host}:{port}; is the port in use? pick another --port")
    server.start()
    log.info("primad listening on %s:%d", host, bound)
    return server, bound
