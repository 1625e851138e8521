"""Finding members over mDNS on 127.0.0.1 when rogues advertise too: a stranger's daemon that
claims a genuine node's id, and an advert for an address where nobody listens, neither end the
search before the genuine nodes answer nor get into the result. Daemon faces run in-process over
mutual TLS (Ping-only, `object()` behind them: the search never calls an RPC)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from prima.coordinator.discovery_options import Discovery
from prima.coordinator.members import Check, check_member, discover_addresses, discover_members
from prima.errors import PlanError
from prima.net import credentials, discovery
from prima.net.credentials import ClusterCA
from prima.net.discovery import Advertiser
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES
from prima.net.node_adverts import NodeAdvert, rank_hosts
from prima.net.server import start_server
from tests.net.hostile_adverts import hostile_adverts

FP = "c3" * 32
LOOPBACK = "127.0.0.1"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterCA]:
    """This process coordinates with a member identity; each test browses its own service type."""
    ca = ClusterCA.create("test cluster")
    credentials.write_private(tmp_path / credentials.IDENTITY_FILE, ca.issue("laptop").to_pem())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(credentials.CLUSTER_DIR_ENV, str(tmp_path))
        mp.setenv(discovery.SERVICE_TYPE_ENV, f"_pm{secrets.token_hex(3)}._tcp.local.")
        yield ca


def _serve(identity: credentials.Identity) -> tuple[grpc.Server, int]:
    return start_server(object(), LOOPBACK, 0, MIN_RECEIVED_MESSAGE_BYTES, identity=identity)  # type: ignore[arg-type]


def test_rogue_adverts_neither_end_the_search_nor_count(cluster: ClusterCA) -> None:
    genuine, genuine_port = _serve(cluster.issue("node0"))
    rogue, rogue_port = _serve(ClusterCA.create("other").issue("node0"))
    adverts = [
        NodeAdvert("node0", LOOPBACK, rogue_port, FP),  # clashes with the genuine node's id
        NodeAdvert("ghost", LOOPBACK, 1, FP),  # nobody listens there
        NodeAdvert("node0", LOOPBACK, genuine_port, FP),
    ]
    advertisers = [Advertiser(a, interfaces=LOOPBACK) for a in adverts]
    try:
        for a in advertisers:
            a.start()
        found = discover_members(5.0, interfaces=LOOPBACK, expect=1, model_fingerprint=FP)
        assert found.addresses == (f"{LOOPBACK}:{genuine_port}",)
        assert found.node_ids == {"node0"}
        # The search above may end before the other adverts are heard; this one hears them all.
        found = discover_members(3.0, interfaces=LOOPBACK, model_fingerprint=FP)
    finally:
        for a in advertisers:
            a.close()
        genuine.stop(grace=None)
        rogue.stop(grace=None)
    assert found.addresses == (f"{LOOPBACK}:{genuine_port}",)
    verdicts = {a.port: found.check(a).verdict for a in found.adverts}
    assert verdicts == {rogue_port: "not a member", 1: "unverified", genuine_port: "member"}


def test_members_are_found_whatever_else_is_advertised(cluster: ClusterCA) -> None:
    """Two members beside 16 address-less instances, 17 malformed TXT records, 40 dead-port
    adverts (two claiming the members' ids) and a plaintext rogue advertising the whole file:
    each of five searches finds both members, and the rogue is marked as no member."""
    servers = [_serve(cluster.issue(f"node{i}")) for i in range(2)]
    rogue, rogue_port = start_server(object(), LOOPBACK, 0, MIN_RECEIVED_MESSAGE_BYTES)  # type: ignore[arg-type]  # plaintext
    genuine = tuple(NodeAdvert(f"node{i}", LOOPBACK, port, FP) for i, (_, port) in enumerate(servers))
    rogue_advert = NodeAdvert("rogue", LOOPBACK, rogue_port, FP, holds_full_file=True)
    service_type = discovery.resolve_service_type()
    try:
        with hostile_adverts(service_type, FP, clash_ids=("node0", "node1"), extra=(rogue_advert, *genuine)):
            for _ in range(5):
                found = discover_members(8.0, interfaces=LOOPBACK, expect=2, model_fingerprint=FP)
                assert found.node_ids == {"node0", "node1"}
                assert set(found.addresses) == {a.address for a in genuine}
            found = discover_members(3.0, interfaces=LOOPBACK, model_fingerprint=FP)  # hears everything
    finally:
        for server, _ in servers:
            server.stop(grace=None)
        rogue.stop(grace=None)
    ports = {rogue_port, *(port for _, port in servers)}
    verdicts = {a.node_id: found.check(a).verdict for a in found.adverts if a.port in ports}
    assert verdicts == {"rogue": "not a member", "node0": "member", "node1": "member"}
    assert {found.check(a).verdict for a in found.adverts if a.node_id.startswith("dead")} == {"unverified"}


def test_adverts_for_another_model_are_left_out(cluster: ClusterCA) -> None:
    server, port = _serve(cluster.issue("node1"))
    advertiser = Advertiser(NodeAdvert("node1", LOOPBACK, port, "d4" * 32), interfaces=LOOPBACK)
    try:
        advertiser.start()
        found = discover_members(1.5, interfaces=LOOPBACK, model_fingerprint=FP)
    finally:
        advertiser.close()
        server.stop(grace=None)
    assert found.addresses == ()
    assert [a.node_id for a in found.adverts] == ["node1"]


def test_every_address_an_advert_lists_is_tried(cluster: ClusterCA) -> None:
    """A daemon listed at two addresses, the first a dead end from here (another interface):
    the second proves membership and is the one kept."""
    server, port = start_server(
        object(), "127.0.0.2", 0, MIN_RECEIVED_MESSAGE_BYTES, identity=cluster.issue("node0")
    )  # type: ignore[arg-type]
    dead, live = f"{LOOPBACK}:{port}", f"127.0.0.2:{port}"
    laptop = cluster.issue("laptop")
    try:
        check = check_member(dead, laptop, (dead, live))
    finally:
        server.stop(grace=None)
    assert check == Check("member", live, "node0")


def test_addresses_are_ranked_lan_ipv4_first() -> None:
    listed = ["fe80::1", "127.0.0.1", "192.168.1.20", "2001:db8::1", "not an address", "192.168.1.20"]
    assert rank_hosts(listed) == ["192.168.1.20", "127.0.0.1", "2001:db8::1", "fe80::1"]


def test_fewer_members_than_expected_is_an_error_naming_them() -> None:
    """Nobody serves this (made-up) model on loopback: 0 of the 1 expected, and what to do."""
    how = Discovery(timeout_s=0.2, interfaces=("127.0.0.1",), expect=1)
    with pytest.raises(PlanError, match=r"0 member\(s\) answered within 0.2 s .adverts: none., expected 1"):
        discover_addresses(how, "0" * 64)
