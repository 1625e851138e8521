"""What a coordinator is told when daemons refuse it, against real daemons on 127.0.0.1: one
serving mutual TLS for a cluster the coordinator is not in, one plaintext. No identity: told it
has none and how to join, the address once; another cluster's identity: the handshake named. In
both, prima's message alone, no gRPC C-core log line before it. Each daemon's ready line says
how it can be called."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima import paths
from prima.coordinator.local_ring import LocalRing
from prima.net import credentials
from prima.net.client import speaks_tls
from prima.net.credentials import ClusterCA

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def tls_node(smollm2_path: Path, logs: Path) -> Iterator[str]:
    with LocalRing.start(1, smollm2_path, ca=ClusterCA.create("theirs"), log_dir=logs / "tls") as ring:
        yield ring.addresses[0]


@pytest.fixture(scope="module")
def plaintext_node(smollm2_path: Path, logs: Path) -> Iterator[str]:
    with LocalRing.start(1, smollm2_path, plaintext=True, log_dir=logs / "plain") as ring:
        yield ring.addresses[0]


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _run_on(address: str, config: Path) -> subprocess.CompletedProcess[str]:
    """`prima run --nodes ADDRESS` as a coordinator whose configuration (identity) is `config`."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", credentials.CLUSTER_DIR_ENV)}
    env[paths.CONFIG_ENV] = str(config)
    return subprocess.run(
        [sys.executable, "-m", "prima.cli.main", "run", "--nodes", address, "-p", "hi", "-n", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def test_a_coordinator_without_identity_is_told_to_join(tls_node: str, tmp_path: Path) -> None:
    done = _run_on(tls_node, tmp_path / "empty")
    assert done.returncode == 1
    (error,) = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert error.startswith(f"prima: error: node at {tls_node} serves mutual TLS and refused this device")
    assert "this device has no cluster identity" in error
    assert "prima cluster join" in error
    assert error.count(tls_node) == 1
    assert "did not answer" not in error
    assert "Handshake failed" not in done.stderr


def test_a_coordinator_of_another_cluster_sees_only_primas_message(tls_node: str, tmp_path: Path) -> None:
    mine = tmp_path / "config"
    identity = ClusterCA.create("mine").issue("desk", role=credentials.ROLE_COORDINATOR)
    (mine / "cluster").mkdir(parents=True)
    credentials.write_private(mine / "cluster" / credentials.IDENTITY_FILE, identity.to_pem())
    done = _run_on(tls_node, mine)
    assert done.returncode == 1
    assert f"prima: error: node at {tls_node} failed the TLS handshake" in done.stderr
    assert "Handshake failed" not in done.stderr  # gRPC's own log line, before prima's


def test_the_tls_probe_tells_a_refusal_from_a_silence(tls_node: str, plaintext_node: str) -> None:
    assert speaks_tls(tls_node)
    assert not speaks_tls(plaintext_node)
    assert not speaks_tls(_free_address())


def test_ready_lines_say_how_a_daemon_is_called(tls_node: str, plaintext_node: str, logs: Path) -> None:
    del tls_node, plaintext_node  # started, and their logs written
    tls = (logs / "tls" / "node0.log").read_text()
    plain = (logs / "plain" / "node0.log").read_text()
    assert "primad: node0 ready on 127.0.0.1:" in tls
    assert "(mutual TLS: members of its cluster only)" in tls
    assert "(plaintext gRPC: no cluster identity, any caller that reaches the port)" in plain
