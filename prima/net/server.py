"""Start a gRPC server for a node handler on host:port (port 0 picks a free one)."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from prima.errors import NodeError
from prima.net.admission import Admission
from prima.net.client import MAX_MESSAGE_BYTES
from prima.net.credentials import Identity, server_credentials
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES, DaemonLimits, received_message_bytes
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.revocation import RevocationList
from prima.net.servicer import FileHolder, FileServicer, NodeHandler, NodeServicer

log = logging.getLogger("prima.net")

# Each open stream (Relay, Generate, FetchRanges) holds a thread for as long as it runs; they
# may take all but CONTROL_THREADS (DaemonLimits.max_streams), which stay for control calls.
MAX_WORKERS = 32
CONTROL_THREADS = 8


def start_server(
    handler: NodeHandler,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int | None = None,
    identity: Identity | None = None,
    limits: DaemonLimits | None = None,
    revoked: RevocationList | None = None,
) -> tuple[grpc.Server, int]:
    """Serve `handler`; return the running server and the port it bound. Messages it receives
    are capped at `max_message_bytes` (default: what the handler's model needs,
    limits.received_message_bytes); those it sends at MAX_MESSAGE_BYTES. With `identity`, over
    mutual TLS: a caller without a certificate from the cluster's CA fails the handshake and
    never reaches a handler, and one whose certificate is in `revoked` gets UNAUTHENTICATED.
    Without, plaintext (primad allows that on loopback only)."""
    bounds = limits or DaemonLimits()
    if bounds.max_streams > MAX_WORKERS - CONTROL_THREADS:
        raise NodeError(
            f"{bounds.max_streams} streams at once would leave fewer than {CONTROL_THREADS} of the server's "
            f"{MAX_WORKERS} threads for control calls; allow at most {MAX_WORKERS - CONTROL_THREADS}"
        )
    if max_message_bytes is None:
        max_message_bytes = min(
            MAX_MESSAGE_BYTES, received_message_bytes(handler.d_model, handler.max_batch_tokens)
        )
    return _serve(NodeServicer(handler, bounds), host, port, max_message_bytes, identity, revoked)


def start_file_server(
    holder: FileHolder,
    host: str,
    port: int = 0,
    identity: Identity | None = None,
    revoked: RevocationList | None = None,
) -> tuple[grpc.Server, int]:
    """Serve only the bytes of `holder`'s model file (Manifest, FetchRanges), as a coordinator
    does for the nodes of its ring that lack them; mutual TLS as in `start_server`."""
    return _serve(FileServicer(holder), host, port, MIN_RECEIVED_MESSAGE_BYTES, identity, revoked)


def _serve(
    servicer: FileServicer,
    host: str,
    port: int,
    max_received_bytes: int,
    identity: Identity | None,
    revoked: RevocationList | None,
) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="primad-rpc"),
        options=[
            ("grpc.max_receive_message_length", max_received_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ],
        interceptors=[Admission(revoked)] if identity is not None else None,
    )
    pb_grpc.add_NodeServicer_to_server(servicer, server)
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
