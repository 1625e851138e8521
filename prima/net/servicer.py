"""The gRPC face of a daemon: decode requests, call the node runtime, encode replies.

The runtime (prima.daemon.runtime) is passed in as a NodeHandler, so this layer holds no state
and imports nothing above it. A PrimaError raised while handling a call ends that call with the
status from prima.net.status and the error's message; the daemon keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from typing import Protocol, TypeVar

import grpc

from prima.engine.generate import GenerateRequest, TokenEvent
from prima.errors import PrimaError, ProtocolError
from prima.model.sparse import SparseFile
from prima.net import codec, fetch, node_status
from prima.net.codec import Activation, NodeProfile, WireDType
from prima.net.credentials import peer_name
from prima.net.limits import CallerSlots, DaemonLimits, StreamBudget, consume_bounded
from prima.net.node_status import NodeStatus
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.run_ahead import WAITING, RunAhead
from prima.net.status import status_details, status_for
from prima.plan import Plan

log = logging.getLogger("prima.net")
T = TypeVar("T")
MAX_FETCH_SOURCES = 16  # peers a LoadPlan may name besides the plan's nodes
GENERATE_POLL_S = 0.25  # how often a waiting Generate looks whether its caller hung up


class NodeHandler(Protocol):
    """What the servicer needs from the node runtime."""

    d_model: int
    vocab_size: int
    max_batch_tokens: int

    def info(self) -> NodeStatus: ...

    def load_plan(
        self,
        plan: Plan,
        node_id: str,
        wire_dtype: WireDType,
        owner: str | None = None,
        fetch_sources: tuple[str, ...] = (),
    ) -> NodeStatus: ...

    def authorize(self, rpc: str, caller: str | None) -> None: ...

    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None: ...

    def close_session(self, session_id: str) -> None: ...

    def accept(self, act: Activation) -> None: ...

    def abort(self, session_id: str, node_id: str, message: str) -> None: ...

    def generate(self, request: GenerateRequest) -> Generator[TokenEvent, None, None]: ...

    def profile(self, peer_address: str, refresh: bool) -> NodeProfile: ...

    store: SparseFile  # the node's model file, whole or partial

    def manifest(self) -> fetch.Manifest: ...


class FileHolder(Protocol):
    """What serving a model file's bytes needs: the file and a manifest of what it holds."""

    store: SparseFile

    def manifest(self) -> fetch.Manifest: ...

    def authorize(self, rpc: str, caller: str | None) -> None: ...


class FileServicer(pb_grpc.NodeServicer):
    """The two RPCs that move a model file's bytes (every other answers UNIMPLEMENTED): what a
    coordinator serves its ring, and part of every daemon."""

    def __init__(self, handler: FileHolder, limits: DaemonLimits | None = None) -> None:
        self.handler = handler
        self.limits = limits or DaemonLimits()
        self._streams = StreamBudget(self.limits.max_streams)
        self._fetches = CallerSlots(self.limits.max_fetches_per_caller, "FetchRanges", self._streams)

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], T], rpc: str = "") -> T:
        """Run `fn` for a call (after checking that its caller may make it, when `rpc` names it)
        and end the call with the status of any PrimaError it raises."""
        try:
            if rpc:
                self.handler.authorize(rpc, peer_name(context))
            return fn()
        except PrimaError as exc:
            details = status_details(exc)
            log.info("answering %s: %s", status_for(exc).name, details)
            context.abort(status_for(exc), details)
            raise AssertionError("context.abort always raises") from exc

    def Manifest(self, request: pb.ManifestRequest, context: grpc.ServicerContext) -> pb.ModelManifest:
        return fetch.manifest_to_proto(self._guard(context, self.handler.manifest))

    def FetchRanges(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.FilePiece]:
        """Bytes of this node's model file, for a node that holds only part of it. Any cluster
        member may ask (the channel proved membership); the bytes are the model every member
        may run anyway. Each piece is read as it is sent, so gRPC's flow control paces the reads."""
        h = self.handler
        chosen = self._guard(context, lambda: fetch.requested_pieces(request, h.manifest()))
        caller = _caller_key(context)
        self._guard(context, lambda: self._fetches.take(caller))
        try:
            for r in chosen:
                if not context.is_active():
                    return
                yield self._guard(context, lambda r=r: fetch.piece_message(h.store, r))
        finally:
            self._fetches.give_back(caller)


class NodeServicer(FileServicer):
    handler: NodeHandler

    def __init__(self, handler: NodeHandler, limits: DaemonLimits | None = None) -> None:
        super().__init__(handler, limits)
        self._generates = CallerSlots(self.limits.max_generates_per_caller, "Generate", self._streams)
        # A session's predecessor relays to this node over one stream (when it has no activation
        # link): at most a stream per session from any one caller.
        self._relays = CallerSlots(self.limits.max_sessions, "Relay", self._streams)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        return node_status.node_status_to_proto(self._guard(context, self.handler.info))

    def LoadPlan(self, request: pb.LoadPlanRequest, context: grpc.ServicerContext) -> pb.LoadPlanReply:
        def load() -> NodeStatus:
            plan = codec.plan_from_proto(request.plan)
            try:
                dtype = WireDType(request.wire_dtype) if request.wire_dtype else WireDType.F32
            except ValueError:
                raise ProtocolError(f"wire dtype {request.wire_dtype} is not one prima knows") from None
            if len(request.fetch_sources) > MAX_FETCH_SOURCES:
                raise ProtocolError(
                    f"{len(request.fetch_sources)} fetch sources; name at most {MAX_FETCH_SOURCES}"
                )
            return self.handler.load_plan(
                plan,
                request.node_id,
                dtype,
                owner=peer_name(context),
                fetch_sources=tuple(request.fetch_sources),
            )

        return pb.LoadPlanReply(info=node_status.node_status_to_proto(self._guard(context, load, "LoadPlan")))

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.Empty:
        h = self.handler
        self._guard(
            context,
            lambda: h.open_session(request.session_id, request.plan_epoch, request.n_ctx),
            "OpenSession",
        )
        return pb.Empty()

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._guard(context, lambda: self.handler.close_session(request.session_id), "CloseSession")
        return pb.Empty()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.Empty:
        h = self.handler
        self._guard(context, lambda: h.abort(request.session_id, request.node_id, request.message), "Abort")
        return pb.Empty()

    def Profile(self, request: pb.ProfileRequest, context: grpc.ServicerContext) -> pb.ProfileReply:
        h = self.handler
        found = self._guard(context, lambda: h.profile(request.peer_address, request.refresh))
        return codec.node_profile_to_proto(found)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingReply:
        return pb.PingReply(received_bytes=len(request.payload))

    def Relay(self, request_iterator: Iterator[pb.Activation], context: grpc.ServicerContext) -> pb.Empty:
        h, bounds = self.handler, self.limits

        def accept(msg: pb.Activation) -> None:
            h.accept(codec.decode_activation(msg, d_model=h.d_model, max_tokens=h.max_batch_tokens))

        def relay() -> None:
            consume_bounded(request_iterator, accept, bounds.relay_idle_s, bounds.relay_open_s)

        caller = _caller_key(context)
        self._guard(context, lambda: self._relays.take(caller), "Relay")  # authorized, then counted
        try:
            self._guard(context, relay)
        finally:
            self._relays.give_back(caller)
        return pb.Empty()

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateReply]:
        """Run a generation on this head and stream its events. The generation runs ahead in a
        thread of its own (prima.net.run_ahead), so writing a token to the coordinator overlaps
        the next token's trip round the ring. A coordinator that hangs up ends it at the next
        token (the generator is closed, which closes the ring session)."""
        h = self.handler
        caller = _caller_key(context)
        self._guard(context, lambda: self._generates.take(caller))
        try:
            events = self._guard(
                context,
                lambda: h.generate(codec.generate_request_from_proto(request, vocab_size=h.vocab_size)),
            )
        except BaseException:
            self._generates.give_back(caller)
            raise
        ahead = RunAhead(events, "primad-generate", on_end=lambda: self._generates.give_back(caller))
        context.add_callback(ahead.stop)  # a caller that hangs up stops a prefill at once, not a poll later
        try:
            while context.is_active():
                event = self._guard(context, lambda: ahead.next(GENERATE_POLL_S))
                if event is WAITING:
                    continue
                if event is None:
                    return
                yield codec.token_event_to_proto(event)  # type: ignore[arg-type]
        finally:
            ahead.stop()


def _caller_key(context: grpc.ServicerContext) -> str:
    """Who is calling, for per-caller bounds: the certificate's name, or on a plaintext daemon
    (loopback only) the caller's IP address."""
    name = peer_name(context)
    if name is not None:
        return name
    host, _, _port = context.peer().rpartition(":")
    return f"plaintext caller {host}"
