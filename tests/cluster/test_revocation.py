"""Removing a device without a new CA, with real daemons: after `prima cluster revoke`, the
daemons answer the revoked member UNAUTHENTICATED and log it once, and a coordinator holding the
list never connects a revoked node into a ring. The member is revoked before the daemons start, so
nothing waits for their reload interval; a running daemon re-reading the list is tested in-process
with an injected clock (tests/net/test_admission.py, tests/net/test_link.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from prima.cli.main import main
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import connect_nodes
from prima.errors import UntrustedNodeError
from prima.net import credentials, revocation
from prima.net.client import open_channel
from prima.net.credentials import ClusterCA
from prima.net.peer_certificate import served_certificate
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterCA, Path]]:
    """This process is the CA device, coordinating as `laptop` (a coordinator's certificate)."""
    where = tmp_path_factory.mktemp("cluster")
    ca = ClusterCA.create("test cluster")
    ca.save(where)
    laptop = ca.issue("laptop", role=credentials.ROLE_COORDINATOR)
    credentials.write_private(where / credentials.IDENTITY_FILE, laptop.to_pem())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(credentials.CLUSTER_DIR_ENV, str(where))
        yield ca, where


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def members(cluster: tuple[ClusterCA, Path]) -> tuple[credentials.Identity, credentials.Identity]:
    """`phone`, issued and then revoked with the CLI, and `tablet`, issued and kept."""
    _, where = cluster
    identities = []
    for name in ("phone", "tablet"):
        out = where / f"{name}.pem"
        assert main(["cluster", "--dir", str(where), "issue", name, "-o", str(out)]) == 0
        identities.append(credentials.Identity.from_pem(out.read_bytes()))
    assert main(["cluster", "--dir", str(where), "revoke", "phone"]) == 0
    return identities[0], identities[1]


@pytest.fixture(scope="module")
def ring(
    cluster: tuple[ClusterCA, Path],
    members: tuple[credentials.Identity, credentials.Identity],
    smollm2_path: Path,
    logs: Path,
) -> Iterator[LocalRing]:
    ca, _ = cluster
    with LocalRing.start(2, smollm2_path, threads=1, ca=ca, log_dir=logs) as ring:
        yield ring


def _ping_code(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        pb_grpc.NodeStub(channel).Ping(pb.PingRequest(), timeout=10)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_a_revoked_member_is_refused_and_logged_once(
    members: tuple[credentials.Identity, credentials.Identity], ring: LocalRing, logs: Path
) -> None:
    phone, tablet = members
    for identity, code in ((tablet, grpc.StatusCode.OK), (phone, grpc.StatusCode.UNAUTHENTICATED)):
        channel = open_channel(ring.addresses[0], identity)
        try:
            for _ in range(3):
                assert _ping_code(channel) == code
        finally:
            channel.close()
    log = (logs / "node0.log").read_text()
    assert log.count("its certificate is revoked") == 1


def test_a_coordinator_never_connects_a_revoked_node(
    cluster: tuple[ClusterCA, Path], ring: LocalRing
) -> None:
    ca, where = cluster
    roots = ca.cert_pem
    serial = served_certificate(ring.addresses[1], roots, 10, "node1").serial_number
    revocation.revoke(ca, where, [serial])
    with pytest.raises(UntrustedNodeError, match="node1 .* revoked certificate"):
        connect_nodes(ring.addresses)
    clients, infos = connect_nodes(ring.addresses, skip_untrusted=True)  # as for discovered nodes
    try:
        assert [i.node_id for i in infos] == ["node0"]
    finally:
        for c in clients:
            c.close()
