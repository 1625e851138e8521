"""Removing a device without a new CA, and roles: a revoked certificate gets UNAUTHENTICATED on
every RPC (logged once), a coordinator's certificate cannot serve or relay as a ring node. The
daemon face runs in-process over mutual TLS on 127.0.0.1 with no runtime behind it (`object()`),
so any call that got past the check would fail differently."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from prima.errors import InputError, UntrustedNodeError
from prima.net import revocation
from prima.net.client import NodeClient, open_channel
from prima.net.credentials import ROLE_COORDINATOR, ClusterCA, Identity
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.revocation import RELOAD_S, RevocationList
from prima.net.server import start_server

from .test_credentials import RPCS, _call


class Clock:
    """Time the revocation list reads, moved by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[ClusterCA, Path]:
    ca = ClusterCA.create("test cluster")
    ca.save(tmp_path)
    return ca, tmp_path


@pytest.fixture
def daemon(cluster: tuple[ClusterCA, Path]) -> Iterator[tuple[str, Clock]]:
    ca, where = cluster
    clock = Clock()
    node = ca.issue("node-a")
    revoked = RevocationList(where / revocation.REVOKED_FILE, node.roots_pem, clock=clock)
    server, port = start_server(
        object(), "127.0.0.1", 0, MIN_RECEIVED_MESSAGE_BYTES, identity=node, revoked=revoked
    )  # type: ignore[arg-type]
    yield f"127.0.0.1:{port}", clock
    server.stop(grace=None)


def _issue(cluster: tuple[ClusterCA, Path], name: str, role: str = "node") -> Identity:
    ca, where = cluster
    identity = ca.issue(name, role=role)
    revocation.record_issued(where, identity)
    return identity


def test_revoked_certificate_gets_unauthenticated_on_every_rpc_logged_once(
    cluster: tuple[ClusterCA, Path], daemon: tuple[str, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    address, clock = daemon
    phone, laptop = _issue(cluster, "phone"), _issue(cluster, "laptop")
    client = NodeClient(address, identity=phone)
    try:
        client.ping()  # a member until revoked
    finally:
        client.close()
    ca, where = cluster
    revocation.revoke(ca, where, revocation.issued_serials(where, "phone"))
    clock.now += RELOAD_S  # the daemon looks at the file again
    channel = open_channel(address, phone)
    try:
        with caplog.at_level(logging.WARNING, logger="prima.net"):
            for rpc in sorted(RPCS):
                with pytest.raises(grpc.RpcError) as info:
                    _call(pb_grpc.NodeStub(channel), rpc)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, rpc
                assert "'phone'" in info.value.details()
                assert "revoked" in info.value.details()
    finally:
        channel.close()
    warnings = [r for r in caplog.records if "revoked" in r.getMessage()]
    assert len(warnings) == 1
    other = NodeClient(address, identity=laptop)  # the rest of the cluster is untouched
    try:
        other.ping()
    finally:
        other.close()


def test_a_coordinators_certificate_cannot_relay(
    cluster: tuple[ClusterCA, Path], daemon: tuple[str, Clock]
) -> None:
    address, _ = daemon
    channel = open_channel(address, _issue(cluster, "laptop", ROLE_COORDINATOR))
    try:
        stub = pb_grpc.NodeStub(channel)
        stub.Ping(RPCS["Ping"](), timeout=5)  # it may call daemons
        with pytest.raises(grpc.RpcError) as info:
            _call(stub, "Relay")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "coordinator's certificate" in info.value.details()
    finally:
        channel.close()


def test_a_coordinators_certificate_cannot_serve_as_a_node(cluster: tuple[ClusterCA, Path]) -> None:
    coordinator = _issue(cluster, "laptop", ROLE_COORDINATOR)
    server, port = start_server(object(), "127.0.0.1", 0, MIN_RECEIVED_MESSAGE_BYTES, identity=coordinator)  # type: ignore[arg-type]
    client = NodeClient(f"127.0.0.1:{port}", identity=_issue(cluster, "phone"), timeout_s=5)
    try:
        with pytest.raises(UntrustedNodeError):
            client.ping()
    finally:
        client.close()
        server.stop(grace=None)


def test_revocation_list_grows_and_is_checked_against_the_ca(cluster: tuple[ClusterCA, Path]) -> None:
    ca, where = cluster
    first, second = _issue(cluster, "phone"), _issue(cluster, "phone")
    revocation.revoke(ca, where, [revocation.issued_serials(where, "phone")[0]])
    revocation.revoke(ca, where, revocation.issued_serials(where, "phone"))
    data = (where / revocation.REVOKED_FILE).read_bytes()
    assert len(revocation.load_crl(data, ca.cert_pem, "crl")) == 2
    assert first.cert_pem != second.cert_pem
    stranger = ClusterCA.create("other")
    with pytest.raises(InputError, match="not signed by this device's cluster CA"):
        revocation.load_crl(data, stranger.cert_pem, "crl")
    with pytest.raises(InputError, match="not a revocation list"):
        revocation.load_crl(b"junk", ca.cert_pem, "crl")


def test_a_broken_copy_keeps_the_previous_list(cluster: tuple[ClusterCA, Path]) -> None:
    ca, where = cluster
    phone = _issue(cluster, "phone")
    revocation.revoke(ca, where, revocation.issued_serials(where, "phone"))
    clock = Clock()
    revoked = RevocationList(where / revocation.REVOKED_FILE, ca.cert_pem, clock=clock)
    cert = x509.load_pem_x509_certificate(phone.cert_pem)
    assert revoked.revoked(cert)
    (where / revocation.REVOKED_FILE).write_bytes(b"half a file")
    clock.now += RELOAD_S
    assert revoked.revoked(cert)
