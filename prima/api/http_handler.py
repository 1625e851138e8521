"""Handling one HTTP request of the OpenAI-compatible API: routing, the API key, reading and
bounding the body, and writing the answer, whole or streamed as server-sent events.

One thread per connection reads and validates its request while another request may be
generating; the generation itself is serialized by the service's queue. This module is the only
place that maps errors to HTTP statuses, and the only one that knows about sockets: it tells the
service a client is gone by peeking at the connection before each token.
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, NoReturn, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prima import metrics
from prima.api.cluster_view import ClusterMonitor
from prima.api.embeddings import embeddings_response, parse_embeddings_request
from prima.api.openai_responses import (
    completion_response,
    error_body,
    models_response,
    response_id,
    stream_chunk,
    usage_chunk,
    usage_of,
)
from prima.api.openai_schema import (
    GenerationRequest,
    ModelNotFoundError,
    RequestError,
)
from prima.api.routes import (
    API_KEY_ENV,
    EMBEDDINGS_ROUTE,
    GET_ROUTES,
    OPEN_PATHS,
    POST_ROUTES,
    ClientGone,
    HttpError,
    HttpLimits,
)
from prima.api.service import CompletionService, ServerBusyError, ServerStoppingError, final_result
from prima.api.shutdown import InFlight
from prima.api.web_page import SECURITY_HEADERS, asset, is_page_file
from prima.engine.generate import GenerationResult
from prima.errors import ContextFullError, GenerationCancelled, InputError, NodeError, PrimaError

log = logging.getLogger("prima.api")


class HandlerServer(Protocol):
    """What a request handler reads of the server it runs in (prima.api.server.ApiServer, which
    builds the handlers): the service, the cluster view, the bounds and key clients are held to,
    the requests in flight, and the nodes' metrics."""

    service: CompletionService
    monitor: ClusterMonitor
    limits: HttpLimits
    api_key: bytes | None
    in_flight: InFlight
    node_metrics: CollectorRegistry

    @property
    def max_body_bytes(self) -> int: ...


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server_version = "prima"
    server: HandlerServer  # type: ignore[assignment]  # an ApiServer, seen as what is read of it

    def setup(self) -> None:
        self.timeout = self.server.limits.idle_timeout_s  # the base class sets it on the socket
        super().setup()

    # --- dispatch --------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch(self._handle_get)

    def do_POST(self) -> None:
        self._dispatch(self._handle_post)

    def do_HEAD(self) -> None:
        """GET's status and headers without its body (RFC 9110, 9.3.2)."""
        self._dispatch(self._handle_get)

    def do_PUT(self) -> None:
        self._dispatch(self._method_not_allowed)

    do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = do_PUT

    def _dispatch(self, handler: Callable[[str], None]) -> None:
        """The error boundary: every failure becomes an OpenAI-style JSON error and the
        connection stays usable unless its framing is in doubt."""
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        self._response_started = False
        self._head_only = self.command == "HEAD"
        try:
            self._check_key(path)
            handler(path)
        except HttpError as exc:
            self._send_error(exc.status, str(exc), exc.err_type, exc.code, headers=exc.headers)
        except ModelNotFoundError as exc:
            self._send_error(
                HTTPStatus.NOT_FOUND, str(exc), "invalid_request_error", "model_not_found", exc.param
            )
        except RequestError as exc:
            self._send_error(
                HTTPStatus.BAD_REQUEST, str(exc), "invalid_request_error", "invalid_request", exc.param
            )
        except ContextFullError as exc:
            self._send_error(
                HTTPStatus.BAD_REQUEST, str(exc), "invalid_request_error", "context_length_exceeded"
            )
        except InputError as exc:
            self._send_error(HTTPStatus.BAD_REQUEST, str(exc), "invalid_request_error", "invalid_request")
        except ServerBusyError as exc:
            self._send_error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "server_error", "server_busy")
        except ServerStoppingError as exc:
            self.close_connection = True  # the server is going: no keep-alive
            self._send_error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                str(exc),
                "server_error",
                "server_shutting_down",
                headers={"Retry-After": "5"},
            )
        except (GenerationCancelled, ClientGone) as exc:
            log.info("%s %s: %s", self.command, path, exc)
            self.close_connection = True
        except NodeError as exc:
            self.server.monitor.record_failure(str(exc))
            self._send_error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "server_error", "node_unavailable")
        except PrimaError as exc:
            log.error("%s %s failed: %s", self.command, path, exc)
            self.server.monitor.record_failure(str(exc))
            self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), "server_error", "internal_error")
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as exc:
            log.info("%s %s: connection lost: %s", self.command, path, exc)
            self.close_connection = True
        except Exception as exc:
            # A bug, not bad input: log the traceback, answer 500, keep serving other clients.
            log.exception("%s %s: unexpected error", self.command, path)
            self.server.monitor.record_failure(f"{self.command} {path}: unexpected {exc.__class__.__name__}")
            self._send_error(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "internal server error; see the server log",
                "server_error",
                "internal_error",
            )

    def _check_key(self, path: str) -> None:
        """With an API key set, every route but OPEN_PATHS and the page's files needs it, compared
        in constant time. A refused request's body is never read, so the connection closes."""
        key = self.server.api_key
        if key is None or path in OPEN_PATHS or (self.command in ("GET", "HEAD") and is_page_file(path)):
            return
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key):
            return
        self.close_connection = True
        raise HttpError(
            HTTPStatus.UNAUTHORIZED,
            "a valid API key is required: send 'Authorization: Bearer <key>' with the key "
            f"`prima serve` was started with (--api-key or ${API_KEY_ENV})"
            if scheme
            else "this server needs an API key: send 'Authorization: Bearer <key>'",
            "invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="prima"'},
        )

    def _handle_get(self, path: str) -> None:
        service = self.server.service
        if path == "/health":
            self._send_json(
                HTTPStatus.SERVICE_UNAVAILABLE if service.stopping else HTTPStatus.OK,
                {
                    "status": "stopping" if service.stopping else "ok",
                    "model": service.model_id,
                    "busy": service.queue.busy,
                    "waiting": service.queue.waiting,
                },
            )
        elif path == "/v1/models":
            cfg = service.loaded.weights.config
            meta = {"context_length": service.n_ctx, "architecture": cfg.arch, "n_layers": cfg.n_layers}
            self._send_json(HTTPStatus.OK, models_response(service.model_id, service.created, meta))
        elif path == "/v1/cluster":
            self._send_json(HTTPStatus.OK, self.server.monitor.snapshot().to_dict())
        elif path == "/metrics":
            body = generate_latest(metrics.SERVE_REGISTRY) + generate_latest(self.server.node_metrics)
            self._send_bytes(HTTPStatus.OK, body, CONTENT_TYPE_LATEST)
        elif (page := asset(path)) is not None:
            self._send_bytes(HTTPStatus.OK, page.data, page.content_type, SECURITY_HEADERS)
        elif path in POST_ROUTES or path == EMBEDDINGS_ROUTE:
            self._method_not_allowed(path)
        else:
            self._not_found(path)

    def _handle_post(self, path: str) -> None:
        if path == EMBEDDINGS_ROUTE:
            body = self._read_json()
            with self._in_flight():
                self._embeddings(body)
            return
        parse = POST_ROUTES.get(path)
        if parse is None:
            self._read_body(self._content_length())  # read and drop it so keep-alive stays in sync
            if path in GET_ROUTES:
                self._method_not_allowed(path)
            self._not_found(path)
        body = self._read_json()  # read before any refusal, so the client reads the answer
        with self._in_flight():
            req = parse(body)
            service = self.server.service
            prep = service.prepare(req)
            events = service.run(prep, self._client_gone)
            try:
                if req.stream:
                    self._stream(req, events)
                else:
                    self._complete(req, events)
            finally:
                events.close()  # releases the engine if we stopped early

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Count this request in flight for a graceful stop, which refuses it if it has begun;
        one the stop ends (cut, or refused while queued) is counted as cut."""
        self.server.service.check_taking_work()
        with self.server.in_flight.track():
            try:
                yield
            except ServerStoppingError:
                self.server.in_flight.mark_cut()
                raise

    def _embeddings(self, body: Any) -> None:
        req = parse_embeddings_request(body)
        service = self.server.service
        result = service.embed(service.prepare_embeddings(req), req.pooling, self._client_gone)
        body = embeddings_response(
            service.model_id, result.vectors, result.prompt_tokens, req.encoding_format
        )
        self._send_json(HTTPStatus.OK, body)

    def _method_not_allowed(self, path: str) -> NoReturn:
        allowed = "POST" if path in POST_ROUTES or path == EMBEDDINGS_ROUTE else "GET, HEAD"
        raise HttpError(
            HTTPStatus.METHOD_NOT_ALLOWED,
            f"{self.command} is not allowed on {path}; use {allowed.replace(', ', ' or ')}",
            "method_not_allowed",
            headers={"Allow": allowed},
        )

    def _not_found(self, path: str) -> NoReturn:
        posts = [*POST_ROUTES, EMBEDDINGS_ROUTE]
        known = ", ".join([*(f"GET {p}" for p in GET_ROUTES), *(f"POST {p}" for p in posts)])
        raise HttpError(
            HTTPStatus.NOT_FOUND, f"no endpoint {self.command} {path}; this server has {known}", "not_found"
        )

    # --- request body ----------------------------------------------------------------------------

    def _content_length(self) -> int:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise HttpError(
                HTTPStatus.LENGTH_REQUIRED,
                "chunked request bodies are not supported; send Content-Length",
                "length_required",
            )
        raw = self.headers.get("Content-Length", "0")
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise HttpError(HTTPStatus.BAD_REQUEST, f"bad Content-Length header {raw!r}", "invalid_request")
        if length > self.server.max_body_bytes:
            self.close_connection = True  # the unread body would be parsed as the next request
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the request body is {length} bytes; the limit is {self.server.max_body_bytes}",
                "request_too_large",
            )
        return length

    def _read_body(self, length: int) -> bytes:
        """`length` bytes of body, all of which must arrive within the body timeout: a client
        trickling a byte at a time holds this thread for seconds, not for as long as it likes."""
        timeout_s = self.server.limits.body_timeout_s
        deadline = time.monotonic() + timeout_s
        chunks: list[bytes] = []
        got = 0
        try:
            while got < length:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(length - got, 1 << 16))
                if not chunk:
                    raise ClientGone("the client closed the connection mid-body")
                chunks.append(chunk)
                got += len(chunk)
        except TimeoutError:
            self.close_connection = True
            raise HttpError(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request body did not arrive within {timeout_s:g} s ({got} of {length} bytes came)",
                "request_timeout",
            ) from None
        finally:
            self.connection.settimeout(self.timeout)
        return b"".join(chunks)

    def _read_json(self) -> Any:
        data = self._read_body(self._content_length())
        if not data.strip():
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "the request body is empty; send a JSON object", "invalid_json"
            )
        try:
            return json.loads(data, parse_constant=_reject_constant)
        except RecursionError:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "the request body is nested too deeply", "invalid_json"
            ) from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {exc}", "invalid_json"
            ) from None

    # --- responses -------------------------------------------------------------------------------

    def _complete(self, req: GenerationRequest, events: Iterator[str | GenerationResult]) -> None:
        result = final_result(events)
        self.server.monitor.record_generation(result.timings)
        model = self.server.service.model_id
        body = completion_response(
            req,
            response_id=response_id(req),
            created=int(time.time()),
            model=model,
            text=result.text,
            stop_reason=result.stop_reason,
            usage=usage_of(result),
            timings=result.timings.as_dict(),
        )
        self._send_json(HTTPStatus.OK, body)

    def _stream(self, req: GenerationRequest, events: Iterator[str | GenerationResult]) -> None:
        """Server-Sent Events in chunked encoding. The first event is awaited before the headers,
        so queueing and prefill errors still get a real HTTP status."""
        first = next(events)
        ident = {
            "response_id": response_id(req),
            "created": int(time.time()),
            "model": self.server.service.model_id,
        }
        self._chunked = self.request_version != "HTTP/1.0"  # HTTP/1.0 has no chunks: end by closing
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self._response_started = True
        if req.kind == "chat":  # chat streams announce the assistant role first; text streams don't
            self._write_event(stream_chunk(req, **ident, first=True))
        event: str | GenerationResult = first
        try:
            while True:
                if isinstance(event, GenerationResult):
                    self.server.monitor.record_generation(event.timings)
                    self._write_event(stream_chunk(req, **ident, stop_reason=event.stop_reason))
                    if req.include_usage:
                        usage = usage_of(event)
                        timings = event.timings.as_dict()
                        self._write_event(usage_chunk(req, **ident, usage=usage, timings=timings))
                    break
                if event:
                    self._write_event(stream_chunk(req, **ident, text=event))
                event = next(events)
        except (GenerationCancelled, ClientGone):
            raise
        except ServerStoppingError as exc:
            log.info("%s: %s", self.path, exc)
            self.server.in_flight.mark_cut()
            self._write_event(error_body(str(exc), "server_error", "server_shutting_down"))
        except PrimaError as exc:
            # The status line is gone already; report in-band like OpenAI does, then end the stream.
            log.error("%s: generation failed mid-stream: %s", self.path, exc)
            self.server.monitor.record_failure(str(exc))
            self._write_event(error_body(str(exc), "server_error", "generation_failed"))
        self._write_chunk(b"data: [DONE]\n\n")
        if self._chunked:
            self._write_chunk(b"")  # the zero-length chunk ends the body

    def _write_event(self, obj: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    def _write_chunk(self, payload: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload) if self._chunked else payload)
            self.wfile.flush()
        except OSError as exc:
            raise ClientGone(f"the client went away mid-stream ({exc.__class__.__name__})") from None

    def _send_json(
        self, status: HTTPStatus, obj: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        self._send_bytes(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def _send_bytes(
        self, status: HTTPStatus, data: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if getattr(self, "_head_only", False):
            return
        try:
            self.wfile.write(data)
        except OSError as exc:
            raise ClientGone(f"the client went away before the response ({exc.__class__.__name__})") from None

    def _send_error(
        self,
        status: HTTPStatus,
        message: str,
        err_type: str,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if getattr(self, "_response_started", False):
            # Mid-response (a stream): a second status line would corrupt it; dropping the connection is all we can do.
            self.close_connection = True
            return
        try:
            self._send_json(status, error_body(message, err_type, code, param), headers)
        except ClientGone:
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors the base class raises itself (malformed request line, oversized headers) in JSON too."""
        self.close_connection = True
        status = HTTPStatus(code)
        self._send_error(
            status, message or status.phrase, "invalid_request_error", status.phrase.lower().replace(" ", "_")
        )

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # --- disconnect detection --------------------------------------------------------------------

    def _client_gone(self) -> bool:
        """True once the peer has closed its end: the socket reads as EOF (or errors).

        Checked before every token, so a vanished client frees the engine within one step."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except ValueError:  # fd beyond select's range: cannot tell, keep generating
            return False
        except OSError:
            return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
