"""A TCP proxy that gives a loopback link the delay, jitter and bandwidth of a home Wi-Fi.

A home cluster's devices talk over Wi-Fi at a few milliseconds and a few hundred Mbit/s; on one
test machine they talk over loopback at microseconds, so neither Halda's network terms nor the
ring's overlap of network and compute are ever tested. The kernel's netem would shape loopback,
but many kernels lack it (this project's test machine among them). This proxy needs nothing but
sockets: put one in front of each daemon's gRPC port and activation link (`--link-port`), on an
address of its own in 127.0.0.0/8, and give the coordinator those addresses.

Each direction of a connection is one queue: a byte chunk leaves the bottleneck when the chunks
before it have (at `mbit_per_s`), then arrives `delay_ms` plus a random jitter later, never
before the chunk ahead of it (TCP keeps order). The queue holds at most `buffer_bytes`, so a
sender feels the rate limit as TCP back-pressure, as over a real link.

Run it by hand: `python -m prima.net.link_shaper --listen 127.0.0.11:7000 --to 127.0.0.1:7000
--delay-ms 5 --jitter-ms 1 --mbit 400` (repeat --listen/--to pairs for the link port).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prima.net.link_socket import shut

log = logging.getLogger("prima.net")

CHUNK_BYTES = 64 << 10
MAX_CONNECTIONS = 64  # a test ring opens a handful; anything more is a bug or a stranger


@dataclass(frozen=True)
class LinkShape:
    """One-way delay (ms), its random extra (uniform 0..jitter_ms), and the bottleneck rate
    (Mbit/s; 0: unlimited)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    mbit_per_s: float = 0.0
    buffer_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.mbit_per_s < 0 or self.buffer_bytes < CHUNK_BYTES:
            raise ValueError(
                f"a link shape needs non-negative figures and a buffer of a chunk or more: {self}"
            )

    def send_s(self, n_bytes: int) -> float:
        """Seconds `n_bytes` take to cross the bottleneck."""
        return n_bytes * 8 / (self.mbit_per_s * 1e6) if self.mbit_per_s else 0.0


class ArrivalClock:
    """When each chunk of one direction arrives (pure: the proxy's timing, testable alone)."""

    def __init__(self, shape: LinkShape, rng: random.Random) -> None:
        self.shape = shape
        self.rng = rng
        self._link_free_s = 0.0
        self._last_arrival_s = 0.0

    def arrival(self, now_s: float, n_bytes: int) -> float:
        leaves = max(now_s, self._link_free_s) + self.shape.send_s(n_bytes)
        self._link_free_s = leaves
        extra = self.rng.uniform(0.0, self.shape.jitter_ms) if self.shape.jitter_ms else 0.0
        arrives = max(leaves + (self.shape.delay_ms + extra) / 1e3, self._last_arrival_s)
        self._last_arrival_s = arrives
        return arrives


class _Direction:
    """Bytes from one socket to another through an ArrivalClock: a reader thread stamps chunks,
    a writer thread delivers each at its time."""

    def __init__(
        self,
        src: socket.socket,
        dst: socket.socket,
        shape: LinkShape,
        rng: random.Random,
        on_end: Callable[[], None],
    ) -> None:
        self.src, self.dst, self.shape = src, dst, shape
        self.on_end = on_end
        self.clock = ArrivalClock(shape, rng)
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._eof = False
        self._cv = threading.Condition()

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._read, daemon=True, name="link-shaper-read"),
            threading.Thread(target=self._write, daemon=True, name="link-shaper-write"),
        ]
        for t in threads:
            t.start()
        return threads

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK_BYTES)
                if not data:
                    break
                with self._cv:
                    while self._queued_bytes + len(data) > self.shape.buffer_bytes and self._queue:
                        self._cv.wait()
                    self._queue.append((self.clock.arrival(time.monotonic(), len(data)), data))
                    self._queued_bytes += len(data)
                    self._cv.notify_all()
        except OSError:
            pass
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._eof:
                        self._cv.wait()
                    if not self._queue:
                        break
                    due, data = self._queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
                with self._cv:
                    self._queue.popleft()
                    self._queued_bytes -= len(data)
                    self._cv.notify_all()
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            with self._cv:  # a writer that failed must not leave its reader waiting for room
                self._queue.clear()
                self._queued_bytes = 0
                self._cv.notify_all()
            self.on_end()


class LinkShaper:
    """Listens on `listen` (host, port; port 0: any) and forwards every connection to `target`
    through a link of `shape`, in both directions."""

    def __init__(
        self, listen: tuple[str, int], target: tuple[str, int], shape: LinkShape, seed: int = 0
    ) -> None:
        self.target = target
        self.shape = shape
        self._rng = random.Random(seed)
        self._server = socket.create_server(listen)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._connections: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0  # connections forwarded so far
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="link-shaper-accept")
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self._closed or len(self._connections) >= MAX_CONNECTIONS:
                    log.warning(
                        "link shaper %s: connection refused (closed, or %d open)",
                        self.address,
                        MAX_CONNECTIONS,
                    )
                    shut(client)
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError as exc:
                log.warning("link shaper %s: cannot reach %s:%d (%s)", self.address, *self.target, exc)
                shut(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            ends = [2]  # directions still running; the last one to end closes both sockets

            def ended(pair: tuple[socket.socket, socket.socket] = pair, ends: list[int] = ends) -> None:
                with self._lock:
                    ends[0] -= 1
                    if ends[0] or pair not in self._connections:
                        return
                    self._connections.remove(pair)
                shut(pair[0])
                shut(pair[1])

            with self._lock:
                self._connections.append(pair)
                self.accepted += 1
                rng = random.Random(self._rng.random())
            _Direction(client, upstream, self.shape, rng, ended).start()
            _Direction(upstream, client, self.shape, random.Random(rng.random()), ended).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        shut(self._server)  # shutdown wakes the acceptor's accept(); close alone does not
        for a, b in connections:
            shut(a)
            shut(b)
        self._acceptor.join(5)

    def __enter__(self) -> LinkShaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def shaped_daemons(
    addresses: Sequence[str], link_ports: Sequence[int], shape: LinkShape, first_host: int = 11
) -> Iterator[tuple[list[str], list[LinkShaper]]]:
    """Daemons on this machine (`addresses`, host:port, each with its activation link on
    `link_ports`) behind a shaper each, on 127.0.0.<first_host + i> with the same ports: the
    addresses to give the coordinator instead, and the shapers (gRPC, link, gRPC, link, ...)."""
    shapers: list[LinkShaper] = []
    fronts = []
    try:
        for i, (address, link_port) in enumerate(zip(addresses, link_ports, strict=True)):
            host, port = address.rsplit(":", 1)
            front = f"127.0.0.{first_host + i}"
            shapers.append(LinkShaper((front, int(port)), (host, int(port)), shape, seed=2 * i))
            shapers.append(LinkShaper((front, link_port), (host, link_port), shape, seed=2 * i + 1))
            fronts.append(f"{front}:{port}")
        yield fronts, shapers
    finally:
        for s in shapers:
            s.close()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prima.net.link_shaper", description=__doc__)
    p.add_argument("--listen", type=_host_port, action="append", required=True, help="HOST:PORT, repeatable")
    p.add_argument(
        "--to", type=_host_port, action="append", required=True, help="HOST:PORT, one per --listen"
    )
    p.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay (default 5)")
    p.add_argument("--jitter-ms", type=float, default=1.0, help="extra delay, uniform 0..J (default 1)")
    p.add_argument("--mbit", type=float, default=400.0, help="bandwidth in Mbit/s, 0 for none (default 400)")
    args = p.parse_args(argv)
    if len(args.listen) != len(args.to):
        p.error("give one --to per --listen")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shape = LinkShape(args.delay_ms, args.jitter_ms, args.mbit)
    shapers = [LinkShaper(src, dst, shape) for src, dst in zip(args.listen, args.to, strict=True)]
    for s in shapers:
        log.info("%s:%d -> %s:%d, %s", *s.address, *s.target, shape)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    for s in shapers:
        s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
