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

from prima.coordinator.members import discover_members
from prima.net import credentials, discovery
from prima.net.credentials import ClusterCA
from prima.net.discovery import Advertiser, NodeAdvert
from prima.net.server import start_server

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
    return start_server(object(), LOOPBACK, 0, identity=identity)  # type: ignore[arg-type]


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
    finally:
        for a in advertisers:
            a.close()
        genuine.stop(grace=None)
        rogue.stop(grace=None)
    assert found.addresses == (f"{LOOPBACK}:{genuine_port}",)
    assert found.node_ids == {"node0"}


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
    from prima.coordinator.members import _members

    server, port = start_server(object(), "127.0.0.2", 0, identity=cluster.issue("node0"))  # type: ignore[arg-type]
    dead, live = f"{LOOPBACK}:{port}", f"127.0.0.2:{port}"
    laptop = cluster.issue("laptop")
    try:
        checked = _members([dead], laptop, {dead: (dead, live)})
    finally:
        server.stop(grace=None)
    assert checked == {dead: None, live: "node0"}


def test_addresses_are_ranked_lan_ipv4_first() -> None:
    listed = ["fe80::1", "127.0.0.1", "192.168.1.20", "2001:db8::1", "not an address", "192.168.1.20"]
    assert discovery.rank_hosts(listed) == ["192.168.1.20", "127.0.0.1", "2001:db8::1", "fe80::1"]
