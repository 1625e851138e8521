"""`prima nodes` on 127.0.0.1 with a cluster identity: every advert marked member / not a member /
unverified, in the table and in --json, and --expect counting members only. Daemon faces run
in-process (a Ping-only server: the command never calls an RPC)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from prima.cli.main import main
from prima.net import credentials, discovery
from prima.net.credentials import ClusterCA
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES
from prima.net.node_adverts import NodeAdvert
from prima.net.server import start_server
from tests.net.hostile_adverts import hostile_adverts

FP = "e5" * 32
LOOPBACK = "127.0.0.1"


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[dict[str, int]]:
    """Ports of a member (node0), a plaintext rogue and another cluster's daemon, advertised
    beside garbage on a private service type; this process holds a member identity."""
    ca = ClusterCA.create("test cluster")
    credentials.write_private(tmp_path / credentials.IDENTITY_FILE, ca.issue("laptop").to_pem())
    servers: list[grpc.Server] = []
    ports: dict[str, int] = {}
    for name, identity in [
        ("node0", ca.issue("node0")),
        ("rogue", None),
        ("stranger", ClusterCA.create("other").issue("stranger")),
    ]:
        server, ports[name] = start_server(
            object(), LOOPBACK, 0, MIN_RECEIVED_MESSAGE_BYTES, identity=identity
        )  # type: ignore[arg-type]
        servers.append(server)
    service_type = f"_pn{secrets.token_hex(3)}._tcp.local."
    adverts = tuple(NodeAdvert(n, LOOPBACK, p, FP, holds_full_file=n == "rogue") for n, p in ports.items())
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(credentials.CLUSTER_DIR_ENV, str(tmp_path))
            mp.setenv(discovery.SERVICE_TYPE_ENV, service_type)
            with hostile_adverts(service_type, FP, addressless=4, malformed=4, dead_ports=4, extra=adverts):
                yield ports
    finally:
        for server in servers:
            server.stop(grace=None)


def test_each_advert_is_marked(ring: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nodes", "--json", "--timeout", "3"]) == 0
    nodes = {n["node_id"]: n for n in json.loads(capsys.readouterr().out)["nodes"]}
    assert {k: nodes[k]["membership"] for k in ring} == {
        "node0": "member",
        "rogue": "not a member",
        "stranger": "not a member",
    }
    assert nodes["node0"]["member_id"] == "node0"
    assert {nodes[f"dead{i}"]["membership"] for i in range(4)} == {"unverified"}
    assert main(["nodes", "--timeout", "3"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "not a member" in rows["rogue"]
    assert rows["node0"].split()[2] == "member"


def test_expect_counts_members_only(ring: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    # 3 live daemons and 4 dead-port adverts answer, but one member: two are not enough.
    assert main(["nodes", "--expect", "2", "--timeout", "2"]) == 1
    assert "found 1 of the 2 member(s) expected" in capsys.readouterr().err
    assert main(["nodes", "--expect", "1", "--timeout", "5", "--json"]) == 0
