"""No false alarms: a coordinator's own membership checks (the certificate probe of a node
found over mDNS, the revocation check) leave no line on a daemon that docs/security.md names as
the sign of a stranger, and a daemon that died is reported as unreachable, not as a non-member.
Real daemons (their own processes, their stderr read), real mDNS on 127.0.0.1."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.errors import NodeError, UntrustedNodeError
from prima.net import credentials, discovery, revocation
from prima.net.client import NodeClient, speaks_tls
from prima.net.credentials import ClusterCA
from prima.net.peer_certificate import served_certificate
from tests.primad_proc import Daemon, start_primad

pytestmark = pytest.mark.slow

STRANGER_LINE = "PEER_DID_NOT_RETURN_A_CERTIFICATE"
LOOPBACK = "127.0.0.1"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ClusterCA:
    """This process (and the `prima` it starts) coordinates with a member's identity and holds
    the cluster's revocation list; every process browses a private service type."""
    ca = ClusterCA.create("home")
    here = tmp_path / "coordinator"
    here.mkdir()
    credentials.write_private(
        here / credentials.IDENTITY_FILE, ca.issue("laptop", role="coordinator").to_pem()
    )
    revocation.revoke(ca, here, [])  # an empty list: every node's certificate is checked anyway
    monkeypatch.setenv(credentials.CLUSTER_DIR_ENV, str(here))
    monkeypatch.setenv(discovery.SERVICE_TYPE_ENV, f"_pq{secrets.token_hex(3)}._tcp.local.")
    return ca


@pytest.fixture
def daemon(cluster: ClusterCA, smollm2_path: Path, tmp_path: Path) -> Iterator[Daemon]:
    own = tmp_path / "node0"
    own.mkdir()
    credentials.write_private(own / credentials.IDENTITY_FILE, cluster.issue("node0").to_pem())
    started = start_primad(LOOPBACK, 0, smollm2_path, tmp_path, env={credentials.CLUSTER_DIR_ENV: str(own)})
    yield started
    started.stop()


def _settled_log(daemon: Daemon) -> str:
    """The daemon's stderr once gRPC had a moment to log a handshake that just ended."""
    time.sleep(1.0)
    return daemon.stderr.read_text(errors="replace")


def test_a_coordinators_checks_raise_no_stranger_alarm(daemon: Daemon, smollm2_path: Path) -> None:
    argv = ["plan", "-m", str(smollm2_path), "--ctx", "64", "--json", "--expect", "1"]
    argv += ["--discover-timeout", "20", "--mdns-interface", LOOPBACK]
    done = subprocess.run(
        [sys.executable, "-m", "prima.cli.main", *argv],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [n["address"] for n in json.loads(done.stdout)["nodes"]] == [daemon.address]
    log = _settled_log(daemon)
    assert STRANGER_LINE not in log
    assert "Handshake failed" not in log
    # The line this test looks for does appear for a caller without a certificate.
    assert speaks_tls(daemon.address)
    assert STRANGER_LINE in _settled_log(daemon)


def test_a_dead_daemon_is_unreachable_not_a_stranger(daemon: Daemon, cluster: ClusterCA) -> None:
    identity = credentials.client_identity()
    assert identity is not None
    assert (
        credentials.cert_name(served_certificate(daemon.address, identity.roots_pem, 5.0, client=identity))
        == "node0"
    )
    client = NodeClient(daemon.address)
    try:
        assert client.info().node_id == "node0"
        client.expect("node0")
        daemon.proc.kill()
        daemon.proc.wait(15)
        with pytest.raises(NodeError) as caught:
            client.info(timeout_s=5.0)
    finally:
        client.close()
    assert not isinstance(caught.value, UntrustedNodeError)
    assert "did not answer" in str(caught.value)
    with pytest.raises(NodeError) as probed:
        served_certificate(daemon.address, identity.roots_pem, 5.0, "node0", client=identity)
    assert not isinstance(probed.value, UntrustedNodeError)
    assert "did not answer" in str(probed.value)
