"""The link shaper: every byte arrives, in order, no earlier than the link's delay and bandwidth
allow (lower bounds only: a loaded machine may add time, never remove it), and connections it
forwarded are let go when their ends close."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from prima.net.link_shaper import ArrivalClock, LinkShape, LinkShaper


def test_arrivals_follow_delay_bandwidth_and_keep_order() -> None:
    shape = LinkShape(delay_ms=5.0, jitter_ms=2.0, mbit_per_s=8.0)  # 1 byte per microsecond
    clock = ArrivalClock(shape, random.Random(1))
    arrivals = [clock.arrival(0.0, 1000) for _ in range(50)]  # 50 chunks sent at once
    assert arrivals == sorted(arrivals)
    for i, t in enumerate(arrivals):
        leaves = (i + 1) * 1e-3  # each kilobyte waits for those before it at the bottleneck
        assert t >= leaves + 5e-3
    assert arrivals[0] <= 1e-3 + 7e-3
    # Jitter moves arrivals within its range, but not before the chunk ahead.
    spread = [t - (i + 1) * 1e-3 - 5e-3 for i, t in enumerate(arrivals)]
    assert max(spread) <= 2e-3 + 1e-12
    assert max(spread) > 0


def test_an_unlimited_link_only_delays() -> None:
    clock = ArrivalClock(LinkShape(delay_ms=3.0), random.Random(0))
    assert clock.arrival(10.0, 1 << 20) == pytest.approx(10.003)
    assert LinkShape().send_s(1 << 30) == 0.0


def test_shapes_reject_negative_figures() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        LinkShape(delay_ms=-1.0)


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    server.close()


def _round_trip(address: tuple[str, int], payload: bytes, timeout_s: float = 30.0) -> tuple[bytes, float]:
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        elapsed = time.monotonic() - start
        sender.join(timeout_s)
    return bytes(got), elapsed


def test_a_small_message_waits_the_delay_both_ways(echo_server: tuple[str, int]) -> None:
    with LinkShaper(("127.0.0.1", 0), echo_server, LinkShape(delay_ms=20.0)) as shaper:
        got, elapsed = _round_trip(shaper.address, b"ping")
    assert got == b"ping"
    assert elapsed >= 0.040


def test_bulk_data_arrives_whole_in_order_at_no_more_than_the_rate(echo_server: tuple[str, int]) -> None:
    payload = random.Random(7).randbytes(1 << 20)
    shape = LinkShape(delay_ms=2.0, jitter_ms=3.0, mbit_per_s=80.0)  # 10 MB/s each way
    with LinkShaper(("127.0.0.1", 0), echo_server, shape) as shaper:
        got, elapsed = _round_trip(shaper.address, payload)
    assert got == payload
    assert elapsed >= len(payload) / 10e6  # the bottleneck, once (the echo overlaps it)


def test_closed_connections_are_let_go(echo_server: tuple[str, int]) -> None:
    with LinkShaper(("127.0.0.1", 0), echo_server, LinkShape(delay_ms=1.0)) as shaper:
        for _ in range(3):
            assert _round_trip(shaper.address, b"x")[0] == b"x"
        deadline = time.monotonic() + 10.0
        while shaper._connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shaper._connections == []
