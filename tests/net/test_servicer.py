"""A daemon answers each malformed or mismatched message with the right gRPC status and a message
naming the problem, and keeps serving. The daemon runs in-process on 127.0.0.1, port 0."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.net import codec
from prima.net.codec import Activation
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.server import start_server
from prima.net.status import MAX_DETAILS_CHARS
from prima.plan import plan_from_window_sizes

MAX_BATCH = 8
MAX_MESSAGE = 1 << 20


@pytest.fixture(scope="module")
def daemon(smollm2_path: Path) -> Iterator[tuple[pb_grpc.NodeStub, NodeRuntime]]:
    loaded = load_model(smollm2_path, layers=range(0))
    runtime = NodeRuntime(loaded, "solo", max_batch_tokens=MAX_BATCH)
    server, port = start_server(runtime, "127.0.0.1", 0, max_message_bytes=MAX_MESSAGE)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.NodeStub(channel)
    # Two nodes in the plan, this one second, so hop 0 is its window; the head is never contacted.
    plan = plan_from_window_sizes(
        [("head", "127.0.0.1:1"), ("solo", f"127.0.0.1:{port}")], [15, 15], 1, 30, epoch=5
    )
    stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="solo"), timeout=60)
    stub.OpenSession(pb.OpenSessionRequest(session_id="s1", plan_epoch=5, n_ctx=64), timeout=10)
    yield stub, runtime
    channel.close()
    server.stop(grace=None)
    runtime.shutdown()


def _activation(**changes: object) -> pb.Activation:
    d = 576
    msg = codec.encode_activation(Activation("s1", 5, 0, np.arange(2), np.zeros((2, d), np.float32)))
    for key, value in changes.items():
        if key == "shape":
            del msg.hidden.shape[:]
            msg.hidden.shape.extend(value)  # type: ignore[arg-type]
        elif key == "dtype":
            msg.hidden.dtype = value  # type: ignore[assignment]
        else:
            setattr(msg, key, value)
    return msg


def _relay_status(stub: pb_grpc.NodeStub, msg: pb.Activation) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.Relay(iter([msg]), timeout=10)
    return info.value


@pytest.mark.parametrize(
    ("msg_changes", "code", "words"),
    [
        ({"shape": [2, 100]}, grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        ({"dtype": 42}, grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
        ({"session_id": "nope"}, grpc.StatusCode.NOT_FOUND, "no session"),
        ({"plan_epoch": 4}, grpc.StatusCode.FAILED_PRECONDITION, "epoch"),
        ({"hop_index": 7}, grpc.StatusCode.INVALID_ARGUMENT, "hop"),
    ],
)
def test_bad_activation_gets_a_status_naming_the_problem(
    daemon: tuple[pb_grpc.NodeStub, NodeRuntime],
    msg_changes: dict[str, object],
    code: grpc.StatusCode,
    words: str,
) -> None:
    stub, _ = daemon
    err = _relay_status(stub, _activation(**msg_changes))
    assert err.code() == code
    assert words in err.details()
    assert stub.Info(pb.InfoRequest(), timeout=10).healthy  # still serving


def test_oversized_batch_is_resource_exhausted(daemon: tuple[pb_grpc.NodeStub, NodeRuntime]) -> None:
    stub, _ = daemon
    n = MAX_BATCH + 1
    big = codec.encode_activation(Activation("s1", 5, 0, np.arange(n), np.zeros((n, 576), np.float32)))
    err = _relay_status(stub, big)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit" in err.details()


def test_oversized_message_is_resource_exhausted(daemon: tuple[pb_grpc.NodeStub, NodeRuntime]) -> None:
    stub, _ = daemon
    msg = _activation()
    msg.hidden.data = b"\0" * (MAX_MESSAGE + 1)
    err = _relay_status(stub, msg)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Info(pb.InfoRequest(), timeout=10).healthy


def test_unknown_session_and_stale_epoch_on_open(daemon: tuple[pb_grpc.NodeStub, NodeRuntime]) -> None:
    stub, _ = daemon
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(pb.OpenSessionRequest(session_id="s2", plan_epoch=3, n_ctx=64), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(pb.OpenSessionRequest(session_id="s1", plan_epoch=5, n_ctx=64), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already open" in info.value.details()


def test_not_the_head_refuses_generate(daemon: tuple[pb_grpc.NodeStub, NodeRuntime]) -> None:
    stub, _ = daemon
    req = pb.GenerateRequest(prompt_ids=[1, 2], max_tokens=2, sampler=codec.sampler_to_proto(SamplerConfig()))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not the head" in info.value.details()


def test_stale_plan_is_refused(daemon: tuple[pb_grpc.NodeStub, NodeRuntime]) -> None:
    stub, _ = daemon
    plan = plan_from_window_sizes(
        [("head", "127.0.0.1:1"), ("solo", "127.0.0.1:2")], [15, 15], 1, 30, epoch=2
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="solo"), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _steps(runtime: NodeRuntime) -> int:
    return sum(h.steps for h in runtime.info().hop_times)


def test_valid_activation_is_accepted_and_computed(daemon: tuple[pb_grpc.NodeStub, NodeRuntime]) -> None:
    stub, runtime = daemon
    before = _steps(runtime)
    # One decode step (timed in hop_times), computed in the worker, then forwarded to a head
    # that is not there.
    step = codec.encode_activation(Activation("s1", 5, 0, np.arange(1), np.zeros((1, 576), np.float32)))
    assert stub.Relay(iter([step]), timeout=10) == pb.Empty()
    deadline = time.monotonic() + 30
    while _steps(runtime) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _steps(runtime) == before + 1


def test_generate_refuses_token_ids_outside_the_vocabulary(
    daemon: tuple[pb_grpc.NodeStub, NodeRuntime],
) -> None:
    stub, runtime = daemon
    req = pb.GenerateRequest(
        prompt_ids=[1, runtime.vocab_size + 7], max_tokens=2, sampler=codec.sampler_to_proto(SamplerConfig())
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in info.value.details()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_generate_refuses_a_temperature_that_is_not_a_number(
    daemon: tuple[pb_grpc.NodeStub, NodeRuntime], temperature: float
) -> None:
    stub, _ = daemon
    sampler = codec.sampler_to_proto(SamplerConfig())
    sampler.temperature = temperature
    req = pb.GenerateRequest(prompt_ids=[1, 2], max_tokens=2, sampler=sampler)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be a finite number" in info.value.details()


def test_an_error_quoting_a_huge_caller_string_is_cut_not_lost(
    daemon: tuple[pb_grpc.NodeStub, NodeRuntime],
) -> None:
    """A 100 kB draft method name is quoted back cut to a bounded length: the caller gets
    INVALID_ARGUMENT and the reason, not RESOURCE_EXHAUSTED for oversized status metadata."""
    stub, _ = daemon
    req = pb.GenerateRequest(
        prompt_ids=[1, 2], max_tokens=2, sampler=codec.sampler_to_proto(SamplerConfig()), draft="d" * 100_000
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "unknown draft method" in details
    assert "more characters cut" in details
    assert len(details) < 2 * MAX_DETAILS_CHARS


def test_a_plan_with_accelerator_layers_is_refused_by_a_cpu_node(
    daemon: tuple[pb_grpc.NodeStub, NodeRuntime],
) -> None:
    stub, runtime = daemon
    plan = plan_from_window_sizes(
        [("head", "127.0.0.1:1"), ("solo", "127.0.0.1:2")], [15, 15], 1, 30, epoch=99
    )
    nodes = (plan.nodes[0], dataclasses.replace(plan.nodes[1], accel_layers=4))
    plan = dataclasses.replace(plan, nodes=nodes)
    with pytest.raises(grpc.RpcError) as info:
        stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="solo"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "accelerator" in info.value.details()
    assert runtime.plan.epoch == 5  # the running plan stays
