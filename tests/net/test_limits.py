"""The bounds on calls, not on data: Generate calls one caller may run at once, and how long a
Relay stream may stay silent or open. A real one-node ring of a tiny random-weight model runs
in-process on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.engine.sampling import SamplerConfig
from prima.errors import ProtocolError
from prima.forward.loader import load_model
from prima.net import codec, link_wire
from prima.net.codec import Activation, positions_from
from prima.net.limits import (
    MIN_RECEIVED_MESSAGE_BYTES,
    CallerSlots,
    DaemonLimits,
    StreamBudget,
    consume_bounded,
    received_message_bytes,
)
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.server import start_server
from prima.net.status import PayloadTooLargeError, StreamTimeoutError
from prima.plan import plan_from_window_sizes

from ..conftest import tiny_model_path

IDLE_S = 0.5


@pytest.fixture(scope="module")
def head_runtime() -> Iterator[NodeRuntime]:
    runtime = NodeRuntime(load_model(tiny_model_path("tiny-qwen2")), "solo")
    yield runtime
    runtime.shutdown()


@pytest.fixture(scope="module")
def head(head_runtime: NodeRuntime) -> Iterator[pb_grpc.NodeStub]:
    """A head holding every layer, allowing one Generate per caller and half a second of silence."""
    runtime = head_runtime
    loaded = runtime.loaded
    bounds = DaemonLimits(max_generates_per_caller=1, relay_idle_s=IDLE_S)
    server, port = start_server(runtime, "127.0.0.1", 0, limits=bounds)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.NodeStub(channel)
    n_layers = loaded.weights.config.n_layers
    plan = plan_from_window_sizes([("solo", f"127.0.0.1:{port}")], [n_layers], 1, n_layers, epoch=1)
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="solo"), timeout=60)
    yield stub
    channel.close()
    server.stop(grace=None)


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_ids=[1, 2, 3],
        max_tokens=max_tokens,
        n_ctx=256,
        sampler=codec.sampler_to_proto(SamplerConfig()),
    )


def test_a_second_concurrent_generate_of_one_caller_is_resource_exhausted(head: pb_grpc.NodeStub) -> None:
    first = head.Generate(_request(200), timeout=60)
    try:
        next(first)  # running: it holds the caller's one slot
        with pytest.raises(grpc.RpcError) as info:
            list(head.Generate(_request(2), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Generate calls running" in info.value.details()
    finally:
        first.cancel()
    # The slot is given back once the first call ends: the same caller may generate again.
    replies: list[pb.GenerateReply] = []
    refusals: set[grpc.StatusCode] = set()
    for _attempt in range(50):
        try:
            replies = list(head.Generate(_request(2), timeout=30))
            break
        except grpc.RpcError as exc:
            refusals.add(exc.code())
            threading.Event().wait(0.1)  # the cancelled call's generator is still closing
    assert refusals <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert replies, "the Generate slot was never given back"
    assert replies[-1].done


def test_a_silent_relay_stream_is_ended_with_deadline_exceeded(head: pb_grpc.NodeStub) -> None:
    release = threading.Event()

    def silent() -> Iterator[pb.Activation]:
        release.wait(30)  # sends nothing until the test ends
        return
        yield

    try:
        with pytest.raises(grpc.RpcError) as info:
            head.Relay(silent(), timeout=30)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"no message on this stream for {IDLE_S:g} s" in info.value.details()
    finally:
        release.set()
    head.Ping(pb.PingRequest(), timeout=10)  # still serving


def test_consume_bounded_hands_every_message_over_in_order() -> None:
    got: list[int] = []
    consume_bounded(iter(range(5)), got.append, idle_s=5.0, open_s=10.0)
    assert got == [0, 1, 2, 3, 4]


def test_consume_bounded_ends_a_stream_open_too_long_though_it_is_busy() -> None:
    release = threading.Event()
    got: list[int] = []

    def chatty() -> Iterator[int]:
        for i in range(1000):  # a message every 10 ms: never idle
            if release.wait(0.01):
                return
            yield i

    try:
        with pytest.raises(StreamTimeoutError, match="open 0.3 s"):
            consume_bounded(chatty(), got.append, idle_s=5.0, open_s=0.3)
    finally:
        release.set()
    assert got[:3] == [0, 1, 2]


def test_consume_bounded_passes_the_stream_error_and_the_handler_error_on() -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise ProtocolError("torn stream")

    got: list[int] = []
    with pytest.raises(ProtocolError, match="torn stream"):
        consume_bounded(broken(), got.append, idle_s=5.0, open_s=10.0)
    assert got == [1]

    def refuse(m: int) -> None:
        if m == 2:
            raise PayloadTooLargeError("too many queued rows")
        got.append(m)

    with pytest.raises(PayloadTooLargeError, match="too many queued rows"):
        consume_bounded(iter(range(5)), refuse, idle_s=5.0, open_s=10.0)
    assert got == [1, 0, 1]  # nothing after the refused message


def test_caller_slots_count_each_caller_apart() -> None:
    slots = CallerSlots(2, "Generate")
    slots.take("a")
    slots.take("a")
    slots.take("b")
    with pytest.raises(PayloadTooLargeError, match="'a' already has 2 Generate calls"):
        slots.take("a")
    slots.give_back("a")
    slots.take("a")


def test_a_cancelled_generate_stops_its_prefill_within_a_micro_batch(
    head: pb_grpc.NodeStub, head_runtime: NodeRuntime
) -> None:
    """A caller that hangs up during a long prompt's prefill: the head stops at the micro-batch
    it is on, not after the whole prompt (which it did: nothing checked before the first token)."""
    n_prompt = 900  # the tiny model's context is 1024
    hops: list[int] = []
    worker = head_runtime.head.worker
    route = worker.route

    def counting(*args: object, **kwargs: object) -> None:
        hops.append(1)
        route(*args, **kwargs)  # type: ignore[arg-type]

    request = pb.GenerateRequest(
        prompt_ids=[(7 * i) % 1000 + 1 for i in range(n_prompt)],
        max_tokens=1,
        n_ctx=1024,
        ubatch=1,  # one micro-batch per token, the head computing each itself
        sampler=codec.sampler_to_proto(SamplerConfig()),
    )
    worker.route = counting  # type: ignore[method-assign]
    try:
        call = head.Generate(request, timeout=120)
        deadline = time.monotonic() + 60
        while len(hops) < 20 and not call.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(hops) >= 20, "the prefill never started"
        call.cancel()
        settled, last = time.monotonic() + 30, -1
        while len(hops) != last and time.monotonic() < settled:  # until a quiet second
            last = len(hops)
            time.sleep(1.0)
    finally:
        worker.route = route  # type: ignore[method-assign]
    # Each micro-batch is routed twice (into the ring, and back as done): the whole prompt is
    # 2 * n_prompt routes, half of them is half the prompt.
    assert len(hops) < n_prompt, (
        f"the cancelled prefill went on for {len(hops) // 2} of {n_prompt} micro-batches"
    )


def test_streams_held_open_leave_threads_for_control_calls(head_runtime: NodeRuntime) -> None:
    """32 silent Relay streams from one caller (the server has 32 threads) used to take every
    thread, and Info timed out. Now one caller holds at most a stream per session, all streams
    together at most DaemonLimits.max_streams, and control calls are answered beside them."""
    bounds = DaemonLimits()
    server, port = start_server(head_runtime, "127.0.0.1", 0, limits=bounds)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.NodeStub(channel)
    release = threading.Event()

    def silent() -> Iterator[pb.Activation]:
        release.wait(60)
        return
        yield

    calls = [stub.Relay.future(silent(), timeout=60) for _ in range(32)]
    try:
        refused = []
        deadline = time.monotonic() + 30
        while len(refused) < 32 - bounds.max_sessions and time.monotonic() < deadline:
            refused = [c for c in calls if c.done() and c.exception() is not None]
            time.sleep(0.05)
        assert len(refused) == 32 - bounds.max_sessions
        for c in refused:
            assert c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[union-attr]
            assert "Relay calls running" in c.exception().details()  # type: ignore[union-attr]
        assert stub.Info(pb.InfoRequest(), timeout=10).node_id == "solo"
        stub.Ping(pb.PingRequest(), timeout=10)
    finally:
        release.set()
        channel.close()
        server.stop(grace=None)


def test_the_stream_budget_is_shared_by_every_kind_and_given_back() -> None:
    budget = StreamBudget(3)
    relays = CallerSlots(2, "Relay", budget)
    generates = CallerSlots(2, "Generate", budget)
    relays.take("a")
    relays.take("b")
    generates.take("a")
    with pytest.raises(PayloadTooLargeError, match="already serves 3 streams"):
        generates.take("c")
    relays.give_back("a")
    generates.take("c")
    assert budget.running == 3
    for slots, caller in [(generates, "a"), (generates, "c"), (relays, "b")]:
        slots.give_back(caller)
    assert budget.running == 0
    one_each = CallerSlots(1, "Relay", StreamBudget(10))
    one_each.take("x")
    with pytest.raises(PayloadTooLargeError, match="'x' already has 1 Relay"):
        one_each.take("x")


@pytest.mark.parametrize(("d_model", "max_tokens"), [(576, 512), (4096, 512), (64, 8), (8192, 2048)])
def test_the_receive_cap_holds_the_largest_micro_batch_a_node_takes(d_model: int, max_tokens: int) -> None:
    """A micro-batch of the most rows a node accepts, float32 (the widest wire type), at
    positions near 2**40, fits the cap on gRPC and on the activation link; twice its rows do not
    (unless the 4 MiB floor covers them), so the cap is no looser than it needs to be."""
    cap = received_message_bytes(d_model, max_tokens)
    start = (1 << 40) - max_tokens
    act = Activation(
        "s" * 128, 1 << 53, 7, positions_from(start, max_tokens), np.ones((max_tokens, d_model), np.float32)
    )
    assert len(codec.encode_activation(act).SerializeToString()) <= cap
    assert len(link_wire.activation_frame(act)) <= cap
    doubled = 2 * max_tokens * d_model * 4
    assert doubled > cap or cap == MIN_RECEIVED_MESSAGE_BYTES
