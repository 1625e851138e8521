"""Who may call a daemon, checked before any handler runs: a gRPC server interceptor that reads
the caller's verified certificate from the TLS auth context. A revoked certificate gets
UNAUTHENTICATED (and one warning in the daemon's log per certificate); a coordinator's
certificate gets PERMISSION_DENIED for the calls only ring nodes make (Relay).

The handshake has already refused callers without a certificate of the cluster: grpcio can only
require client certificates or not ask for them, so such callers never reach this check (see
docs/security.md, "What a caller outside the cluster sees").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from cryptography import x509

from prima.net.credentials import ROLE_COORDINATOR, cert_role
from prima.net.revocation import RevocationList, describe

log = logging.getLogger("prima.net")

NODE_ONLY_METHODS = frozenset({"Relay"})
_WARNED_MAX = 1024


@functools.lru_cache(maxsize=256)
def _parse(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


class Admission(grpc.ServerInterceptor):
    """Refuses revoked certificates and coordinators acting as ring nodes, on every RPC."""

    def __init__(self, revoked: RevocationList | None) -> None:
        self.revoked = revoked
        self._warned: set[int] = set()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]  # type: ignore[attr-defined]
        check = functools.partial(self.check, method=method)
        return _wrapped(handler, check)

    def check(self, context: grpc.ServicerContext, method: str) -> None:
        """Abort the call unless its caller's certificate may make it (plaintext: nothing to check)."""
        pems = context.auth_context().get("x509_pem_cert")
        if not pems:
            return
        refused = self.refusal(_parse(pems[0]), method)
        if refused is not None:
            context.abort(*refused)

    def refusal(self, cert: x509.Certificate, method: str) -> tuple[grpc.StatusCode, str] | None:
        """Why the holder of `cert` may not call `method` (a status and a message), or None if
        it may. Also what the activation link asks of its callers (prima.net.link_server)."""
        if self.revoked is not None and self.revoked.revoked(cert):
            self._warn_once(cert, method)
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"the certificate of {describe(cert)} was revoked by this cluster (prima cluster revoke); "
                "the device must be issued a new identity to take part",
            )
        if method in NODE_ONLY_METHODS and cert_role(cert) == ROLE_COORDINATOR:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{describe(cert)} holds a coordinator's certificate, which cannot take part in a ring as "
                f"a node ({method}); issue the device a node identity (prima cluster issue NAME)",
            )
        return None

    def _warn_once(self, cert: x509.Certificate, method: str) -> None:
        if cert.serial_number in self._warned:
            log.debug("refused %s from revoked %s", method, describe(cert))
            return
        if len(self._warned) >= _WARNED_MAX:
            self._warned.clear()
        self._warned.add(cert.serial_number)
        log.warning("refused %s from %s: its certificate is revoked", method, describe(cert))


def _wrapped(
    handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], None]
) -> grpc.RpcMethodHandler:
    """`handler` with `check(context)` run before each call's behaviour."""
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_uu(request, context)

        return handler._replace(unary_unary=unary_unary)  # type: ignore[attr-defined]
    if handler.unary_stream:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            check(context)
            yield from inner_us(request, context)

        return handler._replace(unary_stream=unary_stream)  # type: ignore[attr-defined]
    if handler.stream_unary:
        inner_su = handler.stream_unary

        def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_su(requests, context)

        return handler._replace(stream_unary=stream_unary)  # type: ignore[attr-defined]
    inner_ss = handler.stream_stream

    def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        check(context)
        yield from inner_ss(requests, context)

    return handler._replace(stream_stream=stream_stream)  # type: ignore[attr-defined]
