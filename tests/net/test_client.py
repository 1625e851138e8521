"""A failed call reads as what happened: a daemon that is not there is told apart from one that
listens but is slow to answer (its first Profile measures the device, or it is busy)."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from prima.net.client import link_estimate, node_error


@pytest.fixture
def slow_server() -> Iterator[str]:
    """A gRPC server on loopback whose one method answers after the caller has given up."""
    release = threading.Event()

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(5.0)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    release.set()
    server.stop(grace=None)


def _failed_call(address: str, timeout_s: float) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/test.Slow/Wait")
        with pytest.raises(grpc.RpcError) as failed:
            call(b"", timeout=timeout_s)
    return failed.value


def test_a_slow_daemon_is_called_busy_not_absent(slow_server: str) -> None:
    error = str(node_error("node0", slow_server, _failed_call(slow_server, 0.2), "Profile"))
    assert "listening but did not answer in time" in error
    assert "Profile: DEADLINE_EXCEEDED" in error
    assert "check that primad is running" not in error


def test_an_absent_daemon_is_called_unreachable() -> None:
    with socket.socket() as probe:  # a port nothing listens on once this socket is closed
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    error = str(node_error("node0", address, _failed_call(address, 2.0), "Info"))
    assert "did not answer (Info: UNAVAILABLE)" in error
    assert "check that primad is running there" in error


def test_link_latency_is_the_typical_round_trip_not_the_luckiest() -> None:
    """Wi-Fi jitters: every hop of every token pays the typical delay, so Halda gets the median."""
    latency_ms, bandwidth = link_estimate([0.010, 0.004, 0.012, 0.011, 0.014], 0.111, 1_000_000)
    assert latency_ms == pytest.approx(5.5)  # half of 11 ms
    assert bandwidth == pytest.approx(1_000_000 / 0.100)


def test_link_bandwidth_below_the_clock_is_unlimited() -> None:
    assert link_estimate([0.001], 0.001, 1 << 20)[1] == math.inf
    assert link_estimate([0.001], 0.0, 0)[1] == math.inf
