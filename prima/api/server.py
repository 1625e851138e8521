"""The HTTP server of the OpenAI-compatible API on the standard library's ThreadingHTTPServer:
binding, the bound on connections at once (more get 429 from a few refusal threads), and a
graceful stop. Requests are handled in prima.api.http_handler, one thread per connection.

A client is bounded (`HttpLimits`): connections at once, the time to send a body and its size,
how long a connection may sit idle. With an API key, every route but /health and the web page's
files needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry

from prima.api.cluster_view import ClusterMonitor
from prima.api.http_handler import ApiHandler
from prima.api.node_metrics import NodeMetricsCollector
from prima.api.openai_responses import (
    error_body,
)
from prima.api.routes import API_KEY_ENV, HttpLimits
from prima.api.service import CompletionService
from prima.api.shutdown import InFlight

__all__ = ["API_KEY_ENV", "ApiServer", "HttpLimits"]

log = logging.getLogger("prima.api")


class ApiServer(ThreadingHTTPServer):
    """The HTTP server bound to one CompletionService. Binding happens in the constructor, so
    the port (use 0 in tests) is known and connectable before `serve_forever` starts.
    `monitor` answers /v1/cluster and hears of every finished generation and failure;
    `api_key`, if set, is required of every request but /health and the page's files."""

    daemon_threads = True
    REFUSALS_AT_ONCE = 8  # threads answering 429 to connections over the limit
    REFUSAL_S = 1.0  # the most time one refusal takes

    def __init__(
        self,
        address: tuple[str, int],
        service: CompletionService,
        monitor: ClusterMonitor | None = None,
        *,
        limits: HttpLimits | None = None,
        api_key: str | None = None,
    ):
        self.service = service
        self.limits = limits or HttpLimits()
        self.api_key = api_key.encode() if api_key else None
        self.monitor = monitor or ClusterMonitor(service.model_id)
        self.in_flight = InFlight()  # generation and embedding requests, for a graceful stop
        # The ring's nodes on /metrics, read from them at each scrape (this server's own
        # families are in metrics.SERVE_REGISTRY).
        self.node_metrics = CollectorRegistry()
        self.node_metrics.register(NodeMetricsCollector(self.monitor.read))
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self._refusals = threading.BoundedSemaphore(self.REFUSALS_AT_ONCE)
        super().__init__(address, ApiHandler)

    @property
    def max_body_bytes(self) -> int:
        return self.limits.max_body_bytes

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own if a slot is free; else answer 429 (on a
        short-lived thread, at most REFUSALS_AT_ONCE of them) or, past that, just close it."""
        if self._slots.acquire(blocking=False):
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._slots.release()
                raise
            return
        log.info("refusing %s: %d connections already", client_address, self.limits.max_connections)
        if not self._refusals.acquire(blocking=False):
            self.shutdown_request(request)
            return
        threading.Thread(target=self._refuse, args=(request,), name="prima-api-refuse", daemon=True).start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, sock: socket.socket) -> None:
        """429 on a connection over the limit; then read (a bounded amount, for a bounded time)
        what the client sent, so closing does not reset the connection before it reads the answer."""
        body = json.dumps(
            error_body(
                f"the server has {self.limits.max_connections} connections open, its limit; retry later",
                "invalid_request_error",
                "too_many_connections",
            )
        ).encode()
        head = (
            f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        ).encode()
        deadline = time.monotonic() + self.REFUSAL_S
        try:
            sock.settimeout(self.REFUSAL_S)
            sock.sendall(head + body)
            sock.shutdown(socket.SHUT_WR)
            for _ in range(64):  # at most 4 MiB
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                sock.settimeout(remaining)
                if not sock.recv(1 << 16):
                    break
        except OSError:
            pass
        finally:
            sock.close()
            self._refusals.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (between requests, or while the response was flushed) is
        routine for a streaming API: one log line, not socketserver's traceback on stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.info("client %s went away: %s", client_address, exc.__class__.__name__)
            return
        super().handle_error(request, client_address)

    def stop_taking_work(self) -> int:
        """Answer every new request for work 503 (and /health 503 "stopping"); the requests in
        flight go on. Returns how many there are."""
        in_flight = self.in_flight.begin_stop()
        self.service.stop_taking_work()
        return in_flight

    def cut_generations(self) -> None:
        """End the running generations at their next token: streams get an error event and
        `[DONE]`, other requests a 503."""
        self.service.close()

    def serve_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="prima-api", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """End running generations at their next token, stop accepting, close the socket.
        Call from a thread other than the one running `serve_forever`."""
        self.service.close()
        self.shutdown()
        self.server_close()
