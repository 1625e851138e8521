"""The protocol errors a daemon answers with, and the gRPC status code each maps to.

Library code (codec, node runtime) raises these; only the servicer turns them into a status, so
a peer's bad message ends that one call and the daemon keeps serving."""

from __future__ import annotations

import grpc

from prima.errors import InputError, NodeError, PlanError, ProtocolError


class UnknownSessionError(ProtocolError):
    """A message names a session this node never opened (or already closed)."""


class StaleEpochError(ProtocolError):
    """A message or session belongs to a plan epoch other than the one loaded."""


class NotReadyError(ProtocolError):
    """The node has no plan yet, or is not the head but was asked to act as one."""


class PayloadTooLargeError(ProtocolError):
    """A tensor or batch exceeds the node's limits."""


class StreamTimeoutError(ProtocolError):
    """A client stream stayed silent, or open, longer than the node allows."""


class PermissionDeniedError(ProtocolError):
    """A cluster member asked for something only another member may do (another coordinator's
    plan, a session of a plan the caller is not in)."""


class ShuttingDownError(NodeError):
    """The daemon is stopping (SIGTERM): it takes no new plan or session, and ends the sessions
    still open at its --shutdown-timeout. Callers should go to another node."""


SHUTTING_DOWN = "is shutting down"  # in every ShuttingDownError's message: how a caller tells one


def status_for(exc: Exception) -> grpc.StatusCode:
    """The gRPC status a servicer answers with for `exc` (most specific class first)."""
    if isinstance(exc, ShuttingDownError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, UnknownSessionError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, StaleEpochError | NotReadyError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, StreamTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, PayloadTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, ProtocolError | PlanError | InputError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NodeError):
        return grpc.StatusCode.ABORTED  # a peer failed; this node itself is fine
    return grpc.StatusCode.INTERNAL


# What a node says back about a failed call is bounded: a message may quote the caller's own
# strings (a node id, a draft name), and gRPC refuses status details past ~8 KiB of metadata, which
# would lose the reason along with the quote.
MAX_DETAILS_CHARS = 1024


def status_details(exc: Exception) -> str:
    """`exc`'s message, cut to MAX_DETAILS_CHARS with a note of how much was left out."""
    text = str(exc)
    if len(text) <= MAX_DETAILS_CHARS:
        return text
    return f"{text[:MAX_DETAILS_CHARS]}... ({len(text) - MAX_DETAILS_CHARS} more characters cut)"
