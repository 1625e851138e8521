"""Talking to one primad: unary calls with deadlines, the per-session Relay stream to a successor,
and the coordinator's Generate stream to the head.

Every gRPC failure leaves this module as a NodeError naming the node and its address (or, for a
status the peer chose, the peer's own message), so callers never see grpc exceptions.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import ssl
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import grpc

from prima.engine.generate import GenerateRequest, GenerationDone, TokenEvent
from prima.errors import NodeError, ProtocolError, UntrustedNodeError
from prima.kernels import compile_cache
from prima.net import codec, credentials, node_status
from prima.net.codec import Activation, NodeProfile, WireDType
from prima.net.link_client import CONNECT_TIMEOUT_S as LINK_CONNECT_TIMEOUT_S
from prima.net.link_client import LinkRelay, open_link
from prima.net.node_status import NodeStatus
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.status import SHUTTING_DOWN
from prima.plan import Plan

log = logging.getLogger("prima.net")

DEFAULT_TIMEOUT_S = 10.0
# Link measurement: a few empty pings for the latency, one payload for the bandwidth.
LINK_PINGS = 5
LINK_PAYLOAD_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Find a peer that vanished without closing its socket within seconds, not minutes.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_END = object()
LINK_RETRY_S = 60.0  # after a node's activation link failed, relay to it over gRPC this long


class Relay(Protocol):
    """A session's activations on their way to one node (RelayStream or LinkRelay)."""

    transport: str  # "grpc" or "link", for metrics and logs

    def send(self, act: Activation) -> None: ...

    def close(self) -> None: ...


def node_error(
    name: str, address: str, exc: grpc.RpcError, doing: str, *, plaintext: bool = False
) -> NodeError:
    """A NodeError for a failed call: unreachable nodes and peer-reported errors read differently.
    `plaintext`: this side called without TLS, so a refusal may be a TLS daemon's (probed)."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    node = f"node at {address}" if name == address else f"node {name} at {address}"
    if code == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in (details or ""):
        return NodeError(f"{doing} on {node}: {details}")  # its own words: it is stopping (SIGTERM)
    if code == grpc.StatusCode.UNAVAILABLE and plaintext and speaks_tls(address):
        return UntrustedNodeError(
            f"{node} serves mutual TLS and refused this device ({doing}): this device has no cluster "
            "identity. On the device that ran `prima cluster init`, run `prima cluster issue NAME --role "
            "coordinator`, then here `prima cluster join NAME.pem` (docs/security.md)"
        )
    # A handshake cut short by a daemon that died reads like a refusal: only a daemon that still
    # listens can have refused this device.
    if code == grpc.StatusCode.UNAVAILABLE and _handshake_failed(details or "") and listening(address):
        return UntrustedNodeError(
            f"{node} failed the TLS handshake ({doing}): it is not a member of this "
            "device's cluster, or this device is not a member of its cluster (or one side has no "
            "credentials); issue it an identity with `prima cluster issue` (docs/security.md)"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return NodeError(
            f"{node} did not answer ({doing}: {code.name}); "
            "check that primad is running there and the address is reachable (on its first start a "
            f"daemon compiles its kernels, {compile_cache.COMPILE_TIME}, before it listens)"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return NodeError(
            f"{node} is listening but did not answer in time ({doing}: {code.name}): it may be busy "
            "(its first Profile measures the device; other work may load it); try again"
        )
    return NodeError(f"{doing} on {node} failed: {details}")


TLS_PROBE_TIMEOUT_S = 2.0


def listening(address: str, timeout_s: float = TLS_PROBE_TIMEOUT_S) -> bool:
    """Whether anything accepts a TCP connection at `address` ("host:port"). Sends no byte, so a
    daemon logs nothing for it (a TLS handshake without a certificate would read as a stranger)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def speaks_tls(address: str, timeout_s: float = TLS_PROBE_TIMEOUT_S) -> bool:
    """Whether a TLS server listens at `address` ("host:port"): a handshake without a client
    certificate gets a TLS answer (done, or the server's alert asking for a certificate), where a
    plaintext gRPC server, or nobody, does not. Certificates are not checked: this only tells a
    refusal from a silence."""
    host, _, port = address.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock,
            context.wrap_socket(sock),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "").upper()
    except (OSError, ValueError):
        return False


# How a client calls: with this identity; "plaintext"; or None, this process's own
# (credentials.client_identity()).
Transport = credentials.Identity | Literal["plaintext"] | None


def _handshake_failed(details: str) -> bool:
    """Whether an UNAVAILABLE status came from TLS (a peer or a caller without the cluster's
    certificate, or plaintext against TLS) rather than from nobody listening."""
    words = details.lower()
    return any(
        w in words for w in ("handshake", "ssl", "certificate", "tls", "verification", "unauthenticated")
    )


def open_channel(
    address: str, identity: credentials.Identity | None, node_id: str | None = None
) -> grpc.Channel:
    """A channel to `address`: mutual TLS when this process has a cluster identity (the handshake
    proves that the peer holds `node_id`'s certificate, or any member's without one), plaintext
    otherwise."""
    if identity is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = [*CHANNEL_OPTIONS, credentials.target_name_option(node_id)]
    return grpc.secure_channel(address, credentials.channel_credentials(identity), options=options)


def link_estimate(rtts_s: Sequence[float], payload_rtt_s: float, payload_bytes: int) -> tuple[float, float]:
    """(one-way latency ms, bytes/s) from empty round trips and one round trip carrying
    `payload_bytes` (seconds): see NodeClient.measure_link."""
    rtt = statistics.median(rtts_s)
    extra = payload_rtt_s - rtt if payload_bytes else 0.0
    bandwidth = payload_bytes / extra if extra > 1e-6 else math.inf
    return rtt * 1e3 / 2, bandwidth


class NodeClient:
    """One channel to one daemon; cheap to keep for a session (HTTP/2 multiplexes calls).
    With `node_id`, only a daemon holding that node's certificate is accepted at that address."""

    def __init__(
        self,
        address: str,
        name: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        node_id: str | None = None,
        identity: Transport = None,
    ) -> None:
        self.address = address
        self.name = name or node_id or address
        self.timeout_s = timeout_s
        if identity is None:
            identity = credentials.client_identity()
        self.identity = None if identity == "plaintext" else identity
        self.node_id = node_id
        self.channel = open_channel(address, self.identity, node_id)
        self.stub = pb_grpc.NodeStub(self.channel)
        self._link_port: int | None = None  # the node's activation link, once asked
        self._link_retry_at = 0.0

    def expect(self, node_id: str) -> None:
        """From now on accept only `node_id`'s certificate at this address (the id a daemon
        claimed in Info is then proven by the handshake of every later call)."""
        self.name = node_id
        self.node_id = node_id
        if self.identity is None:
            return
        self.channel.close()
        self.channel = open_channel(self.address, self.identity, node_id)
        self.stub = pb_grpc.NodeStub(self.channel)

    def _call(
        self, doing: str, fn: Callable[..., object], request: object, timeout_s: float | None = None
    ) -> object:
        try:
            return fn(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise node_error(self.name, self.address, exc, doing, plaintext=self.identity is None) from None
        except ValueError as exc:  # grpc: "Cannot invoke RPC on closed channel!"
            raise NodeError(f"{doing} on node {self.name} at {self.address}: {exc}") from None

    def info(self, timeout_s: float | None = None) -> NodeStatus:
        return node_status.node_status_from_proto(
            self._call("Info", self.stub.Info, pb.InfoRequest(), timeout_s)
        )

    def load_plan(
        self,
        plan: Plan,
        node_id: str,
        wire_dtype: WireDType = WireDType.F32,
        fetch_sources: Sequence[str] = (),
    ) -> NodeStatus:
        """Send `plan`; a node that must first fetch its windows answers at once with a status
        that says so (see prima.coordinator.readiness)."""
        req = pb.LoadPlanRequest(
            plan=codec.plan_to_proto(plan),
            node_id=node_id,
            wire_dtype=int(wire_dtype),
            fetch_sources=list(fetch_sources),
        )
        # Loading validates the node's layers and may start reading them: allow longer.
        reply = self._call("LoadPlan", self.stub.LoadPlan, req, self.timeout_s * 6)
        return node_status.node_status_from_proto(reply.info)

    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None:
        req = pb.OpenSessionRequest(session_id=session_id, plan_epoch=plan_epoch, n_ctx=n_ctx)
        self._call("OpenSession", self.stub.OpenSession, req)

    def close_session(self, session_id: str) -> None:
        self._call("CloseSession", self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id))

    def abort(self, session_id: str, node_id: str, message: str) -> None:
        req = pb.AbortRequest(session_id=session_id, node_id=node_id, message=message)
        self._call("Abort", self.stub.Abort, req)

    def profile(self, peer_address: str = "", refresh: bool = False) -> NodeProfile:
        """The node's DeviceProfile; with `peer_address` its link to that node is measured too.
        A node may measure itself first (about a second), so this allows longer than other calls."""
        req = pb.ProfileRequest(peer_address=peer_address, refresh=refresh)
        reply = self._call("Profile", self.stub.Profile, req, self.timeout_s * 6)
        try:
            return codec.node_profile_from_proto(reply)
        except ProtocolError as exc:
            raise NodeError(f"node {self.name} at {self.address} sent an unusable profile: {exc}") from None

    def ping(self, payload_bytes: int = 0) -> float:
        """Seconds for one Ping round trip carrying `payload_bytes` to the node."""
        req = pb.PingRequest(payload=bytes(payload_bytes))
        t0 = time.perf_counter()
        self._call("Ping", self.stub.Ping, req)
        return time.perf_counter() - t0

    def measure_link(
        self, pings: int = LINK_PINGS, payload_bytes: int = LINK_PAYLOAD_BYTES
    ) -> tuple[float, float]:
        """(one-way latency ms, bytes/s) to this node: half the median of `pings` empty round
        trips, and one `payload_bytes` ping less that round trip. Bandwidth is inf when the
        payload's extra time is below the clock's resolution (loopback, fast LANs). The median,
        not the best: on Wi-Fi every hop of every token pays the typical delay, jitter
        included, and the best round trip is the luckiest."""
        self.ping()  # the first call on a channel also connects: not a sample
        rtts = [self.ping() for _ in range(max(1, pings))]
        return link_estimate(rtts, self.ping(payload_bytes) if payload_bytes else 0.0, payload_bytes)

    def relay(self, on_error: Callable[[NodeError], None], wire_dtype: WireDType = WireDType.F32) -> Relay:
        """A session's relay to this node: over its activation link when it has one that
        answers (prima.net.link_client), else over a gRPC Relay stream."""
        sock = self._open_link()
        if sock is not None:
            return LinkRelay(sock, self.name, self.address, on_error, wire_dtype)
        return RelayStream(self, on_error, wire_dtype)

    def _open_link(self) -> socket.socket | None:
        """A connected activation link, or None (no link advertised, or it failed lately)."""
        now = time.monotonic()
        if now < self._link_retry_at:
            return None
        if self._link_port is None:
            try:
                self._link_port = self.info(timeout_s=LINK_CONNECT_TIMEOUT_S).link_port
            except NodeError:
                return None
        if not self._link_port:
            return None
        host = self.address.rpartition(":")[0]
        try:
            return open_link(host, self._link_port, self.identity, self.node_id)
        except (OSError, ssl.SSLError) as exc:
            log.warning(
                "node %s: its activation link at %s:%d failed (%s); relaying over gRPC instead, which "
                "costs more per hop (open that port too, see docs/ring.md)",
                self.name,
                host,
                self._link_port,
                exc,
            )
            self._link_port = None  # asked again next time: the daemon may have restarted
            self._link_retry_at = now + LINK_RETRY_S
            return None

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        """Token ids as the head samples them, then one GenerationDone. Closing the iterator
        early cancels the generation on the head."""
        return iter(GenerateStream(self, request))

    def close(self) -> None:
        self.channel.close()


class GenerateStream:
    """One Generate call: iterate it for the token events; `cancel()`, from any thread, ends a
    read that is waiting (the iteration then raises NodeError), e.g. when the head has hung."""

    def __init__(self, client: NodeClient, request: GenerateRequest) -> None:
        self.client = client
        self._call = client.stub.Generate(codec.generate_request_to_proto(request))

    def __iter__(self) -> Iterator[TokenEvent]:
        name, address = self.client.name, self.client.address
        try:
            for reply in self._call:
                event = codec.token_event_from_proto(reply)
                yield event
                if isinstance(event, GenerationDone):
                    return
        except grpc.RpcError as exc:
            raise node_error(name, address, exc, "Generate") from None
        except ProtocolError as exc:
            raise NodeError(f"node {name} at {address} sent an unusable reply: {exc}") from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class RelayStream:
    """One open Relay call to a successor for one session: `send` queues an activation and
    returns at once; a gRPC thread drains the queue onto the stream. If the call fails, the
    error goes to `on_error` once and later sends raise it."""

    transport = "grpc"

    def __init__(
        self, client: NodeClient, on_error: Callable[[NodeError], None], wire_dtype: WireDType
    ) -> None:
        self.client = client
        self.wire_dtype = wire_dtype
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._on_error = on_error
        self.error: NodeError | None = None
        self._future = client.stub.Relay.future(self._requests())
        self._future.add_done_callback(self._done)

    def _requests(self) -> Iterator[pb.Activation]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def _done(self, future: grpc.Future) -> None:
        exc = future.exception()
        if exc is None or self.error is not None:
            return
        self.error = node_error(self.client.name, self.client.address, exc, "Relay")  # type: ignore[arg-type]
        self._on_error(self.error)

    def send(self, act: Activation) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put(codec.encode_activation(act, self.wire_dtype))

    def close(self) -> None:
        self._queue.put(_END)
