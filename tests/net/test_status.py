"""The gRPC status each error answers with (most specific class first), and status details cut
to a size gRPC still carries, saying how much was cut."""

from __future__ import annotations

import grpc
import pytest

from prima.errors import (
    ContextFullError,
    InputError,
    ModelFileError,
    NodeError,
    PlanError,
    ProtocolError,
    UntrustedNodeError,
)
from prima.net.status import (
    MAX_DETAILS_CHARS,
    NotReadyError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ShuttingDownError,
    StaleEpochError,
    StreamTimeoutError,
    UnknownSessionError,
    status_details,
    status_for,
)

Code = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ShuttingDownError("node a is shutting down"), Code.UNAVAILABLE),
        (UnknownSessionError("no session s"), Code.NOT_FOUND),
        (StaleEpochError("epoch 4, not 5"), Code.FAILED_PRECONDITION),
        (NotReadyError("no plan"), Code.FAILED_PRECONDITION),
        (StreamTimeoutError("silent"), Code.DEADLINE_EXCEEDED),
        (PermissionDeniedError("not yours"), Code.PERMISSION_DENIED),
        (PayloadTooLargeError("too big"), Code.RESOURCE_EXHAUSTED),
        (ProtocolError("bad shape"), Code.INVALID_ARGUMENT),
        (PlanError("layers unassigned"), Code.INVALID_ARGUMENT),
        (InputError("bad token id"), Code.INVALID_ARGUMENT),
        (ContextFullError("full"), Code.INVALID_ARGUMENT),
        (NodeError("the next node went away"), Code.ABORTED),
        (UntrustedNodeError("revoked"), Code.ABORTED),
        (ModelFileError("truncated"), Code.INTERNAL),
        (ValueError("a bug"), Code.INTERNAL),
    ],
)
def test_each_error_answers_with_its_status(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc) == code


def test_short_details_are_the_message() -> None:
    text = "x" * MAX_DETAILS_CHARS
    assert status_details(ProtocolError(text)) == text


def test_long_details_are_cut_saying_how_much() -> None:
    details = status_details(ProtocolError("y" * (MAX_DETAILS_CHARS + 500)))
    assert details == "y" * MAX_DETAILS_CHARS + "... (500 more characters cut)"
