"""Cluster credentials: identities round-trip through their one file, and the mutual-TLS
handshake admits members of the cluster only, and only the node a caller asked for."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from prima.errors import InputError, NodeError, UntrustedNodeError
from prima.net import credentials
from prima.net.client import NodeClient, open_channel
from prima.net.credentials import ClusterCA, Identity
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc
from prima.net.server import start_server


@pytest.fixture(scope="module")
def ca() -> ClusterCA:
    return ClusterCA.create("test cluster")


@pytest.fixture(scope="module")
def node_port(ca: ClusterCA) -> Iterator[int]:
    """A daemon face (Ping needs no runtime) serving as node `node-a` over mutual TLS."""
    server, port = start_server(
        object(), "127.0.0.1", 0, MIN_RECEIVED_MESSAGE_BYTES, identity=ca.issue("node-a")
    )  # type: ignore[arg-type]
    yield port
    server.stop(grace=None)


def test_identity_round_trips_through_its_file(ca: ClusterCA) -> None:
    ident = ca.issue("phone")
    again = Identity.from_pem(ident.to_pem())
    assert again == ident
    assert again.name == "phone"


def test_identity_file_without_a_ca_is_refused(ca: ClusterCA) -> None:
    ident = ca.issue("phone")
    with pytest.raises(InputError, match="CA"):
        Identity.from_pem(ident.key_pem + ident.cert_pem)
    with pytest.raises(InputError, match="not a prima identity"):
        Identity.from_pem(b"garbage")


@pytest.mark.parametrize("name", ["", "x" * 64, "tab\there"])
def test_unusable_member_names_are_refused(ca: ClusterCA, name: str) -> None:
    with pytest.raises(InputError, match="member name"):
        ca.issue(name)


def test_ca_saves_owner_only_and_loads(ca: ClusterCA, tmp_path) -> None:
    ca.save(tmp_path / "c")
    assert (tmp_path / "c" / credentials.CA_KEY_FILE).stat().st_mode & 0o077 == 0
    assert ClusterCA.load(tmp_path / "c") == ca
    with pytest.raises(InputError, match="prima cluster init"):
        ClusterCA.load(tmp_path / "missing")


def test_member_is_admitted(ca: ClusterCA, node_port: int) -> None:
    client = NodeClient(f"127.0.0.1:{node_port}", identity=ca.issue("coordinator"))
    try:
        client.ping()
        client.expect("node-a")  # the certificate names node-a: the handshake agrees
        client.ping()
    finally:
        client.close()


def test_another_clusters_member_fails_the_handshake(node_port: int) -> None:
    stranger = ClusterCA.create("other").issue("coordinator")
    client = NodeClient(f"127.0.0.1:{node_port}", identity=stranger, timeout_s=5)
    try:
        with pytest.raises(UntrustedNodeError, match="TLS handshake"):
            client.ping()
    finally:
        client.close()


def test_a_node_posing_as_another_fails_the_handshake(ca: ClusterCA, node_port: int) -> None:
    client = NodeClient(f"127.0.0.1:{node_port}", identity=ca.issue("coordinator"), node_id="node-b")
    try:
        with pytest.raises(UntrustedNodeError):
            client.ping()
    finally:
        client.close()


def test_plaintext_caller_is_refused(node_port: int) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{node_port}")
    try:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/prima.v1.Node/Ping")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()


def test_unreachable_node_is_not_called_untrusted(ca: ClusterCA) -> None:
    client = NodeClient("127.0.0.1:1", identity=ca.issue("coordinator"), timeout_s=2)
    try:
        with pytest.raises(NodeError) as info:
            client.ping()
        assert not isinstance(info.value, UntrustedNodeError)
    finally:
        client.close()


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("0.0.0.0", False)])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert credentials.is_loopback(host) is loopback


RPCS = {
    "Info": pb.InfoRequest,
    "LoadPlan": pb.LoadPlanRequest,
    "OpenSession": pb.OpenSessionRequest,
    "CloseSession": pb.CloseSessionRequest,
    "Abort": pb.AbortRequest,
    "Profile": pb.ProfileRequest,
    "Ping": pb.PingRequest,
    "Generate": pb.GenerateRequest,
    "Relay": pb.Activation,
    "Manifest": pb.ManifestRequest,
    "FetchRanges": pb.FetchRequest,
}


@pytest.mark.parametrize("stranger", ["plaintext", "tls-without-certificate", "other-cluster"])
@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_every_rpc_refuses_callers_outside_the_cluster(
    ca: ClusterCA, node_port: int, rpc: str, stranger: str
) -> None:
    """UNAVAILABLE at the handshake (NodeClient maps it to UntrustedNodeError): no handler runs.
    grpcio can only require a client certificate or not ask for one (it does not expose "ask,
    but let the call through"), so a caller without one cannot get as far as an UNAUTHENTICATED
    status; docs/security.md says what each kind of stranger sees."""
    address = f"127.0.0.1:{node_port}"
    if stranger == "plaintext":
        channel = grpc.insecure_channel(address)
    elif stranger == "tls-without-certificate":  # trusts the cluster's CA, shows no certificate
        creds = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem)
        channel = grpc.secure_channel(address, creds, options=[credentials.target_name_option(None)])
    else:
        channel = open_channel(address, ClusterCA.create("other").issue("coordinator"))
    try:
        with pytest.raises(grpc.RpcError) as info:
            _call(pb_grpc.NodeStub(channel), rpc)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()


def _call(stub: pb_grpc.NodeStub, rpc: str) -> None:
    """Call `rpc` with an empty request, reading a streamed reply to its end."""
    call = getattr(stub, rpc)
    request = RPCS[rpc]()
    if rpc == "Relay":
        call(iter([request]), timeout=5)
    elif rpc in ("Generate", "FetchRanges"):
        list(call(request, timeout=5))
    else:
        call(request, timeout=5)


def test_every_rpc_is_tested() -> None:
    assert set(RPCS) == set(pb.DESCRIPTOR.services_by_name["Node"].methods_by_name)
