"""The activation link: a real daemon runtime in this process listens on 127.0.0.1 with a
throwaway cluster CA's certificates. Activations over the link are computed in order; a caller
outside the cluster, a coordinator, a revoked device or the wrong node fails; every malformed or
hostile frame ends that link with a message naming the problem, and the daemon keeps serving; a
node without a reachable link is relayed to over gRPC."""

from __future__ import annotations

import random
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from prima.daemon.runtime import NodeRuntime
from prima.daemon.worker import INLINE_MAX_TOKENS
from prima.engine.warmup import ensure_compiled
from prima.errors import NodeError
from prima.forward.loader import load_model
from prima.net import credentials, link_tls, link_wire, revocation
from prima.net.client import NodeClient, RelayStream
from prima.net.codec import Activation, WireDType
from prima.net.limits import DaemonLimits
from prima.net.link_client import LinkRelay, open_link
from prima.net.link_server import LinkServer
from prima.net.link_socket import read_exactly
from prima.net.revocation import RevocationList
from prima.net.server import start_server
from prima.plan import plan_from_window_sizes
from tests.fake_time import FakeTime
from tests.net.link_errors import Errors

IDLE_S = 1.0
MAX_MESSAGE = 1 << 20
D_MODEL = 576
EPOCH = 5


@dataclass
class Daemon:
    runtime: NodeRuntime
    link: LinkServer
    grpc_port: int
    ca: credentials.ClusterCA
    ca_dir: Path
    head: credentials.Identity  # the plan's other node: a legitimate sender
    clock: FakeTime  # the time the revocation list reads, moved by the tests


@pytest.fixture(scope="module")
def daemon(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # Kernels compiled first, as primad does before it serves: compiled on the first activation
    # instead (a cold cache, this module run alone), they would outlast the tests' waits.
    ensure_compiled(smollm2_path)
    ca_dir = tmp_path_factory.mktemp("ca")
    ca = credentials.ClusterCA.create("link test")
    solo, head = ca.issue("solo"), ca.issue("head")
    loaded = load_model(smollm2_path, layers=range(0))
    bounds = DaemonLimits(relay_idle_s=IDLE_S, max_sessions=64)
    runtime = NodeRuntime(loaded, "solo", max_batch_tokens=8, identity=head, bounds=bounds)
    clock = FakeTime()
    revoked = RevocationList(ca_dir / revocation.REVOKED_FILE, solo.roots_pem, clock=clock.perf_counter)
    server, port = start_server(runtime, "127.0.0.1", 0, identity=solo, limits=bounds, revoked=revoked)
    link = LinkServer(
        runtime, "127.0.0.1", 0, identity=solo, limits=bounds, revoked=revoked, max_message_bytes=MAX_MESSAGE
    )
    runtime.link_port = link.port
    # Two nodes, this one second: hop 0 is its window; the head (port 1) is never reached.
    plan = plan_from_window_sizes(
        [("head", "127.0.0.1:1"), ("solo", f"127.0.0.1:{port}")], [15, 15], 1, 30, epoch=EPOCH
    )
    runtime.load_plan(plan, "solo", WireDType.F32, owner="coordinator")
    yield Daemon(runtime, link, port, ca, ca_dir, head, clock)
    link.close()
    server.stop(grace=None)
    runtime.shutdown()


def _session(daemon: Daemon, name: str) -> str:
    daemon.runtime.open_session(name, EPOCH, 64)
    return name


def _act(session: str, first: int = 0, n: int = 1, **changes: object) -> Activation:
    act = Activation(session, EPOCH, 0, np.arange(first, first + n), np.zeros((n, D_MODEL), np.float32))
    for key, value in changes.items():
        object.__setattr__(act, key, value)
    return act


def _relay(daemon: Daemon, identity: credentials.Identity | None, errors: Errors) -> LinkRelay:
    sock = open_link("127.0.0.1", daemon.link.port, identity, "solo")
    return LinkRelay(sock, "solo", f"127.0.0.1:{daemon.link.port}", errors)


def _steps(daemon: Daemon) -> int:
    return sum(h.steps for h in daemon.runtime.info().hop_times)


def _wait_for_steps(daemon: Daemon, n: int) -> None:
    deadline = time.monotonic() + 30
    while _steps(daemon) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _steps(daemon) == n


def test_activations_over_the_link_are_computed_in_order(daemon: Daemon) -> None:
    errors = Errors()
    relay = _relay(daemon, daemon.head, errors)
    before = _steps(daemon)
    sid = _session(daemon, "in-order")
    for position in range(3):
        relay.send(_act(sid, position))  # three decode steps; out of order, the cache would have a gap
    _wait_for_steps(daemon, before + 3)
    relay.close()
    assert not errors.got


def test_a_decode_step_behind_a_queued_prompt_waits_for_it(daemon: Daemon) -> None:
    """A prompt micro-batch too long to compute in the thread it arrives on queues for the compute
    thread; a decode step arriving right behind it, which alone would be computed where it
    arrives, must wait for it (computed first, it would leave a gap in the KV cache)."""
    sid = _session(daemon, "prompt-then-step")
    gaps = REGISTRY.get_sample_value("prima_node_errors_total", {"kind": "cache_gap"}) or 0.0
    before = _steps(daemon)
    n = INLINE_MAX_TOKENS + 4
    runtime = daemon.runtime
    for _ in range(3):
        runtime.worker.submit(_act(sid, 0, n), runtime.need_layout(), runtime.need_session(sid))
        runtime.worker.submit(_act(sid, n), runtime.need_layout(), runtime.need_session(sid))
    _wait_for_steps(daemon, before + 3)
    assert (REGISTRY.get_sample_value("prima_node_errors_total", {"kind": "cache_gap"}) or 0.0) == gaps


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"session_id": "nope"}, "no session"),
        ({"plan_epoch": 4}, "epoch"),
        ({"hop_index": 7}, "hop"),
        ({"hidden": np.zeros((1, 100), np.float32)}, "shape"),
        ({"positions": np.arange(9), "hidden": np.zeros((9, D_MODEL), np.float32)}, "limit"),
    ],
)
def test_a_bad_activation_ends_the_link_with_a_message_naming_the_problem(
    daemon: Daemon, changes: dict[str, object], words: str
) -> None:
    errors = Errors()
    relay = _relay(daemon, daemon.head, errors)
    relay.send(_act(_session(daemon, f"bad-{words}"), **changes))
    message = errors.wait()
    assert words in message
    assert "node solo" in message
    # Later sends fail with an error too (the socket may take a moment to notice the hang-up).
    assert _sends_fail(relay, _act("any"))
    _still_serving(daemon)


def _sends_fail(relay: LinkRelay, act: Activation) -> bool:
    for _ in range(50):
        try:
            relay.send(act)
        except NodeError:
            return True
        time.sleep(0.02)
    return False


def _still_serving(daemon: Daemon) -> None:
    errors = Errors()
    relay = _relay(daemon, daemon.head, errors)
    before = _steps(daemon)
    relay.send(_act(_session(daemon, f"after-{time.monotonic_ns()}")))
    _wait_for_steps(daemon, before + 1)
    relay.close()
    assert not errors.got


def _raw_tls(daemon: Daemon) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", daemon.link.port), timeout=10)
    return link_tls.client_context(daemon.head).wrap_socket(raw, server_hostname=link_tls.target_name("solo"))


def _hang_up_frame(sock: ssl.SSLSocket) -> tuple[str, str]:
    """(status, message) of the error frame the node sent as it hung up."""
    got = link_wire.read_frame(lambda n: read_exactly(sock, n), link_wire.MAX_ERROR_BYTES)
    assert got is not None
    assert got[0] == link_wire.ERROR
    return link_wire.parse_error(got[1])


def _hang_up_message(sock: ssl.SSLSocket) -> str:
    return _hang_up_frame(sock)[1]


@pytest.mark.parametrize(
    ("sent", "words"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "activation link"),
        (
            link_wire.MAGIC + link_wire.HEADER.pack(MAX_MESSAGE + 1, link_wire.ACTIVATION),
            "over this node's limit",
        ),
        (link_wire.MAGIC + link_wire.frame(9, b"x"), "unknown kind"),
        (link_wire.MAGIC + link_wire.frame(link_wire.ERROR, b"x"), "only activations"),
        (link_wire.MAGIC + link_wire.frame(link_wire.ACTIVATION, b"\xff" * 20), "shorter than its"),
        (link_wire.MAGIC + link_wire.frame(link_wire.ACTIVATION, b"\xff" * 40), "no session_id"),
    ],
)
def test_hostile_bytes_end_that_link_with_a_message(daemon: Daemon, sent: bytes, words: str) -> None:
    with _raw_tls(daemon) as sock:
        sock.sendall(sent)
        assert words in _hang_up_message(sock)
    _still_serving(daemon)


def test_a_silent_link_is_ended(daemon: Daemon) -> None:
    with _raw_tls(daemon) as sock:
        sock.sendall(link_wire.MAGIC)
        assert f"no message on this link for {IDLE_S:g} s" in _hang_up_message(sock)


def test_a_device_outside_the_cluster_fails_the_handshake(daemon: Daemon) -> None:
    stranger = credentials.ClusterCA.create("another cluster").issue("head")
    with pytest.raises(ssl.SSLError):
        # TLS 1.3: the server's refusal of our certificate arrives after the handshake.
        open_link("127.0.0.1", daemon.link.port, stranger, "solo").recv(1)
    _still_serving(daemon)


def test_a_plaintext_caller_gets_nothing(daemon: Daemon) -> None:
    errors = Errors()
    relay = _relay(daemon, None, errors)
    assert "closed the activation link" in errors.wait() or "ended the activation link" in errors.wait()
    relay.close()
    _still_serving(daemon)


def test_the_wrong_node_at_the_address_fails_the_handshake(daemon: Daemon) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        open_link("127.0.0.1", daemon.link.port, daemon.head, "somebody-else")


def test_a_coordinator_certificate_may_not_relay(daemon: Daemon) -> None:
    coordinator = daemon.ca.issue("laptop", role=credentials.ROLE_COORDINATOR)
    errors = Errors()
    _relay(daemon, coordinator, errors)
    assert "coordinator's certificate" in errors.wait()


def test_a_node_outside_the_plan_may_not_relay(daemon: Daemon) -> None:
    errors = Errors()
    _relay(daemon, daemon.ca.issue("intruder"), errors)
    assert "neither a node of plan epoch" in errors.wait()


def test_a_revoked_certificate_is_refused(daemon: Daemon) -> None:
    phone = daemon.ca.issue("phone")
    revocation.record_issued(daemon.ca_dir, phone)
    revocation.revoke(daemon.ca, daemon.ca_dir, revocation.issued_serials(daemon.ca_dir, "phone"))
    daemon.clock.advance(revocation.RELOAD_S)  # the list is looked at again after RELOAD_S
    errors = Errors()
    _relay(daemon, phone, errors)
    assert "revoked" in errors.wait()


def test_a_client_relays_over_the_link_when_the_node_has_one_else_over_grpc(daemon: Daemon) -> None:
    def relay_to(link_port: int) -> object:
        daemon.runtime.link_port = link_port
        client = NodeClient(f"127.0.0.1:{daemon.grpc_port}", identity=daemon.head, node_id="solo")
        try:
            relay = client.relay(lambda err: None)
            kind = type(relay)
            relay.close()
            return kind
        finally:
            client.close()

    try:
        assert relay_to(daemon.link.port) is LinkRelay
        assert relay_to(0) is RelayStream  # no link advertised
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            unused = closed.getsockname()[1]
        assert relay_to(unused) is RelayStream  # advertised but nobody answers there
    finally:
        daemon.runtime.link_port = daemon.link.port


FUZZ_LINKS = 60
FUZZ_SEED = 7
ANSWERS = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


def test_mutated_frames_never_break_the_node(daemon: Daemon) -> None:
    """Seeded byte flips, cuts and additions to a valid link opening: each link is answered with
    a status naming a problem of the caller's (never INTERNAL) or silence while it waits for
    more, and a valid link afterwards is computed as before."""
    rng = random.Random(FUZZ_SEED)
    sid = _session(daemon, "fuzz")
    valid = link_wire.MAGIC + link_wire.activation_frame(_act(sid))
    answered: set[str] = set()
    for _ in range(FUZZ_LINKS):
        data = bytearray(valid)
        for _flip in range(rng.randint(1, 6)):
            where = rng.randrange(len(data))
            choice = rng.random()
            if choice < 0.6:
                data[where] = rng.randrange(256)
            elif choice < 0.8:
                del data[where:]
                if not data:
                    data = bytearray(b"\0")
            else:
                data[where:where] = rng.randbytes(rng.randint(1, 64))
        with _raw_tls(daemon) as sock:
            sock.sendall(bytes(data))
            sock.settimeout(0.2)
            try:
                status = _hang_up_frame(sock)[0]
            except TimeoutError:
                continue  # the node waits for the rest of a frame, or computed a valid one
            assert status in ANSWERS
            answered.add(status)
    assert "INVALID_ARGUMENT" in answered
    _still_serving(daemon)
