"""The API's routes and the errors a request is refused with before it reaches the service:
what prima.api.http_handler dispatches on, and what it maps to HTTP statuses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
