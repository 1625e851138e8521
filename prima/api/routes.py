"""The API's routes, the bounds on a client, and the errors a request is refused with before it
reaches the service: what prima.api.http_handler dispatches on and holds clients to, and what it
maps to HTTP statuses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from prima.api.openai_schema import GenerationRequest, parse_chat_request, parse_completion_request

API_KEY_ENV = "PRIMA_API_KEY"
OPEN_PATHS = ("/health",)  # answer without a key (and the web page's files, which hold no data)
POST_ROUTES: dict[str, Callable[[Any], GenerationRequest]] = {
    "/v1/chat/completions": parse_chat_request,
    "/v1/completions": parse_completion_request,
}
EMBEDDINGS_ROUTE = "/v1/embeddings"
GET_ROUTES = ("/", "/health", "/v1/models", "/v1/cluster", "/metrics")


@dataclass(frozen=True)
class HttpLimits:
    """What one client may make the server hold. Each bound is answered with a 4xx naming it."""

    max_body_bytes: int = 1 << 20  # 1 MiB: far above any prompt that fits a context
    body_timeout_s: float = 10.0  # the whole body must arrive within this (408 otherwise)
    idle_timeout_s: float = 30.0  # per read of a request line or header, keep-alive idle, per write
    max_connections: int = 64  # connections served at once; more get 429 and are closed


class HttpError(Exception):
    """A request refused before it reaches the service (routing, body framing, JSON, key)."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        code: str,
        err_type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.err_type = err_type
        self.headers = headers


class ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""
