"""A relay flood from several threads at a daemon of its own process, with the daemon's peak
memory (VmHWM) and thread count read from /proc/PID/status while it runs. Used by
test_relay_flood_memory.py; `python -m tests.cluster.relay_flood` runs it at full size and
prints what it measured."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from prima.net import codec, link_wire
from prima.net.codec import Activation
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc

D_MODEL = 576  # smollm2-135m
CALL_S = 60.0
SAMPLE_S = 0.05
FLOOD_CTX = 1024  # the flood session queues at most this many tokens: two 512-token batches


def status(pid: int) -> dict[str, int]:
    """The numeric fields of /proc/PID/status (memory in KiB, Threads a count)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0])
    return out


@dataclass
class Watch:
    """Samples a process's status until stopped: the highest VmHWM and thread count seen."""

    pid: int
    peak_hwm_kib: int = 0
    peak_threads: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._sample()

    def _sample(self) -> None:
        s = status(self.pid)
        self.peak_hwm_kib = max(self.peak_hwm_kib, s["VmHWM"])
        self.peak_threads = max(self.peak_threads, s["Threads"])
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()


def activation(session: str, epoch: int, tokens: int, data_bytes: int = 0) -> pb.Activation:
    """A Relay message of `tokens` rows at hop 0; with `data_bytes`, a tensor whose bytes do not
    match its shape, that large."""
    msg = codec.encode_activation(
        Activation(session, epoch, 0, np.arange(tokens), np.zeros((tokens, D_MODEL), np.float32))
    )
    if data_bytes:
        msg.hidden.data = bytes(data_bytes)
    return msg


def flood(
    stub: pb_grpc.NodeStub, kinds: list[list[pb.Activation]], threads: int, streams: int, deadline_s: float
) -> list[grpc.StatusCode]:
    """Each of `threads` threads opens up to `streams` Relay streams within `deadline_s`, the
    streams sending each of `kinds` of messages in turn; the status of every stream."""
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()
    deadline = time.monotonic() + deadline_s

    def send(first: int) -> None:
        for i in range(streams):
            if time.monotonic() > deadline:
                return
            try:
                stub.Relay(iter(kinds[(first + i) % len(kinds)]), timeout=CALL_S)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            with lock:
                codes.append(code)

    senders = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=deadline_s + CALL_S)
    return codes


def link_flood(
    port: int, frames: list[list[bytes]], threads: int, connections: int, deadline_s: float
) -> list[str]:
    """The same on the activation link (plaintext, as the daemon's is): each of `threads` threads
    opens up to `connections` connections in turn, each sending MAGIC and then each of `frames`
    kinds in turn, and reading what comes back; the first line of every error frame."""
    answers: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + deadline_s

    def send(first: int) -> None:
        for i in range(connections):
            if time.monotonic() > deadline:
                return
            with socket.create_connection(("127.0.0.1", port), timeout=CALL_S) as sock:
                try:
                    sock.sendall(link_wire.MAGIC)
                    for f in frames[(first + i) % len(frames)]:
                        sock.sendall(f)
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # refused part-way: the daemon closed the link after its error frame
                reply = _read_all(sock)
            kind = (
                reply[link_wire.HEADER.size : link_wire.HEADER.size + 40]
                .split(b"\n")[0]
                .decode(errors="replace")
            )
            with lock:
                answers.append(kind or "closed")

    senders = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=deadline_s + CALL_S)
    return answers


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    except OSError:
        pass
    return b"".join(chunks)


def run(
    stub: pb_grpc.NodeStub,
    pid: int,
    epoch: int,
    message_bytes: int,
    threads: int,
    streams: int,
    deadline_s: float,
    beside: Callable[[], object] | None = None,
) -> tuple[Watch, list[grpc.StatusCode], int]:
    """The flood (streams of a refused message of `message_bytes`, and streams of the longest
    batches the daemon takes) with the daemon watched; also the daemon's VmRSS before it, in KiB."""
    stub.OpenSession(
        pb.OpenSessionRequest(session_id="flood", plan_epoch=epoch, n_ctx=FLOOD_CTX), timeout=CALL_S
    )
    kinds = [[activation("flood", epoch, 1, message_bytes)], [activation("flood", epoch, 512)] * 4]
    before_kib = status(pid)["VmRSS"]
    with Watch(pid) as watch:
        side = threading.Thread(target=beside) if beside is not None else None
        if side is not None:
            side.start()
        codes = flood(stub, kinds, threads, streams, deadline_s)
        if side is not None:
            side.join(timeout=CALL_S * 4)
    stub.CloseSession(pb.CloseSessionRequest(session_id="flood"), timeout=CALL_S)
    return watch, codes, before_kib


def run_link(
    stub: pb_grpc.NodeStub,
    pid: int,
    epoch: int,
    message_bytes: int,
    threads: int,
    connections: int,
    deadline_s: float,
    beside: Callable[[], object] | None = None,
) -> tuple[Watch, list[str], int]:
    """`run` on the daemon's activation link: connections sending one frame of `message_bytes`
    (zeros: refused from its header if over the cap, else as unparseable), and connections
    sending the longest batches the daemon takes."""
    port = stub.Info(pb.InfoRequest(), timeout=CALL_S).link_port
    stub.OpenSession(
        pb.OpenSessionRequest(session_id="flood", plan_epoch=epoch, n_ctx=FLOOD_CTX), timeout=CALL_S
    )
    valid = link_wire.activation_frame(
        Activation("flood", epoch, 0, np.arange(512), np.zeros((512, D_MODEL), np.float32))
    )
    frames = [
        [link_wire.HEADER.pack(message_bytes, link_wire.ACTIVATION) + bytes(message_bytes)],
        [valid] * 4,
    ]
    before_kib = status(pid)["VmRSS"]
    with Watch(pid) as watch:
        side = threading.Thread(target=beside) if beside is not None else None
        if side is not None:
            side.start()
        answers = link_flood(port, frames, threads, connections, deadline_s)
        if side is not None:
            side.join(timeout=CALL_S * 4)
    stub.CloseSession(pb.CloseSessionRequest(session_id="flood"), timeout=CALL_S)
    return watch, answers, before_kib


def _main() -> None:
    from prima.coordinator.local_ring import LocalRing
    from prima.model.files import resolve_model
    from prima.plan import plan_from_window_sizes

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--message-mib", type=float, default=60)
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    ring = LocalRing.start(
        1,
        resolve_model("smollm2-135m"),
        threads=1,
        extra_args=("--exact", "--max-kv-mib", "64"),
        plaintext=True,
    )
    try:
        channel = grpc.insecure_channel(ring.addresses[0], options=[("grpc.max_send_message_length", -1)])
        stub = pb_grpc.NodeStub(channel)
        plan = plan_from_window_sizes([("node0", ring.addresses[0])], [30], 1, 30, epoch=1)
        stub.LoadPlan(pb.LoadPlanRequest(plan=codec.plan_to_proto(plan), node_id="node0"), timeout=CALL_S)
        pid = ring.nodes[0].pid
        t0 = time.monotonic()
        watch, codes, before = run(
            stub, pid, 1, int(args.message_mib * (1 << 20)), args.threads, args.streams, args.seconds
        )
        print(  # noqa: T201 - the script's output
            f"{len(codes)} streams in {time.monotonic() - t0:.1f} s: "
            f"{ {c.name: codes.count(c) for c in set(codes)} }; VmRSS before {before >> 10} MiB, "
            f"peak VmHWM {watch.peak_hwm_kib >> 10} MiB (+{(watch.peak_hwm_kib - before) >> 10}), "
            f"threads at most {watch.peak_threads} ({watch.samples} samples)"
        )
    finally:
        ring.close()


if __name__ == "__main__":
    _main()
