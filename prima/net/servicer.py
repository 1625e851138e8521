"""The gRPC face of a daemon: decode requests, call the node runtime, encode replies.

The runtime (prima.cluster.daemon) is passed in as a NodeHandler, so this layer holds no state
and imports nothing above it. A PrimaError raised while handling a call ends that call with the
status from prima.net.status and the error's message; the daemon keeps serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import grpc
import numpy as np

from prima.engine.generate import GenerationResult
from prima.engine.sampling import SamplerConfig
from prima.errors import PrimaError
from prima.net import codec
from prima.net.codec import Activation, NodeProfile, NodeStatus, WireDType
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.status import status_for
from prima.scheduler.plan import Plan

log = logging.getLogger("prima.net")
T = TypeVar("T")


class ForwardSession(Protocol):
    def forward(self, token_ids: list[int], reset: bool) -> np.ndarray: ...

    def close(self) -> None: ...


class NodeHandler(Protocol):
    """What the servicer needs from the node runtime."""

    d_model: int
    max_batch_tokens: int

    def info(self) -> NodeStatus: ...

    def load_plan(self, plan: Plan, node_id: str, wire_dtype: WireDType) -> NodeStatus: ...

    def open_session(self, session_id: str, plan_epoch: int, n_ctx: int) -> None: ...

    def close_session(self, session_id: str) -> None: ...

    def accept(self, act: Activation) -> None: ...

    def abort(self, session_id: str, node_id: str, message: str) -> None: ...

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampler: SamplerConfig,
        stop_ids: list[int],
        n_ctx: int,
        cancelled: threading.Event,
        ubatch: int = 0,
    ) -> Iterator[int | GenerationResult]: ...

    def open_forward(self, n_ctx: int, ubatch: int = 0) -> ForwardSession: ...

    def profile(self, peer_address: str, refresh: bool) -> NodeProfile: ...


class NodeServicer(pb_grpc.NodeServicer):
    def __init__(self, handler: NodeHandler) -> None:
        self.handler = handler

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except PrimaError as exc:
            log.info("answering %s: %s", status_for(exc).name, exc)
            context.abort(status_for(exc), str(exc))
            raise AssertionError("context.abort always raises") from exc

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        return codec.node_status_to_proto(self._guard(context, self.handler.info))

    def LoadPlan(self, request: pb.LoadPlanRequest, context: grpc.ServicerContext) -> pb.LoadPlanReply:
        def load() -> NodeStatus:
            plan = codec.plan_from_proto(request.plan)
            dtype = WireDType(request.wire_dtype) if request.wire_dtype else WireDType.F32
            return self.handler.load_plan(plan, request.node_id, dtype)

        return pb.LoadPlanReply(info=codec.node_status_to_proto(self._guard(context, load)))

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.Empty:
        h = self.handler
        self._guard(context, lambda: h.open_session(request.session_id, request.plan_epoch, request.n_ctx))
        return pb.Empty()

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._guard(context, lambda: self.handler.close_session(request.session_id))
        return pb.Empty()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.Empty:
        h = self.handler
        self._guard(context, lambda: h.abort(request.session_id, request.node_id, request.message))
        return pb.Empty()

    def Profile(self, request: pb.ProfileRequest, context: grpc.ServicerContext) -> pb.ProfileReply:
        h = self.handler
        found = self._guard(context, lambda: h.profile(request.peer_address, request.refresh))
        return codec.node_profile_to_proto(found)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingReply:
        return pb.PingReply(received_bytes=len(request.payload))

    def Relay(self, request_iterator: Iterator[pb.Activation], context: grpc.ServicerContext) -> pb.Empty:
        h = self.handler

        def relay() -> None:
            for msg in request_iterator:
                h.accept(codec.decode_activation(msg, d_model=h.d_model, max_tokens=h.max_batch_tokens))

        self._guard(context, relay)
        return pb.Empty()

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateReply]:
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        events = self._guard(
            context,
            lambda: self.handler.generate(
                list(request.prompt_ids),
                request.max_tokens,
                codec.sampler_from_proto(request.sampler),
                list(request.stop_ids),
                request.n_ctx,
                cancelled,
                request.ubatch,
            ),
        )
        while True:
            event = self._guard(context, lambda: next(events, None))
            if event is None:
                return
            if isinstance(event, GenerationResult):
                t = event.timings
                yield pb.GenerateReply(
                    done=True, stop_reason=event.stop_reason, prompt_ms=t.prompt_ms, generate_ms=t.generate_ms
                )
                return
            yield pb.GenerateReply(token_id=event)

    def Forward(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardReply]:
        session: ForwardSession | None = None
        try:
            for request in request_iterator:
                if session is None:
                    session = self._guard(
                        context, lambda r=request: self.handler.open_forward(r.n_ctx, r.ubatch)
                    )
                logits = self._guard(
                    context, lambda r=request, s=session: s.forward(list(r.token_ids), r.reset)
                )
                yield pb.ForwardReply(logits=codec.encode_tensor(logits))
        finally:
            if session is not None:
                session.close()
