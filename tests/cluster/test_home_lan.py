"""A home LAN in network namespaces (tests/netns_lan.py): devices at non-loopback addresses,
each with its own host name, their daemons advertising over mDNS on the LAN's bridge.

- Secure by default: a coordinator without a cluster identity never sends a request to a
  plaintext daemon off loopback (named with --nodes or advertised), and says how to form a
  cluster."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from prima.net import discovery
from prima.net.client import NodeClient
from tests.netns_lan import Device, Lan, home_lan, skip_reason
from tests.primad_proc import start_primad

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0  # a daemon's first start may compile its kernels
COMMAND_TIMEOUT_S = 120.0
PORT = 7000  # primad's default: every device uses it, as at home


@pytest.fixture(scope="module")
def lan() -> Iterator[Lan]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with home_lan() as made:
        yield made


def prima(
    argv: Sequence[str], *, env: dict[str, str], device: Device | None = None
) -> subprocess.CompletedProcess[str]:
    """The `prima` CLI as its own process (its credentials are its own), in `device`'s
    namespace or this host's."""
    cmd = [sys.executable, "-m", "prima.cli.main", *argv]
    return subprocess.run(
        device.argv(cmd) if device else cmd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def test_a_coordinator_without_identity_never_uses_a_plaintext_daemon_elsewhere(
    lan: Lan, smollm2_path: Path, tmp_path: Path
) -> None:
    service = f"_pl{secrets.token_hex(3)}._tcp.local."
    no_identity = tmp_path / "no-identity"
    no_identity.mkdir()
    env = {"PRIMA_CLUSTER_DIR": str(no_identity), discovery.SERVICE_TYPE_ENV: service}
    rogue_device = lan.add("rogue")
    rogue = start_primad(
        rogue_device.ip, PORT, smollm2_path, tmp_path, "--insecure", env=env, wrap=rogue_device.argv
    )
    address = f"{rogue_device.ip}:{PORT}"
    try:
        base = ["-m", str(smollm2_path), "--ctx", "64"]
        named = prima(["run", *base, "-p", "secret prompt", "-n", "2", "--nodes", address], env=env)
        assert named.returncode != 0
        assert f"refusing to use {address}" in named.stderr
        assert "prima cluster init" in named.stderr
        assert "prima cluster join" in named.stderr
        # Advertised: found over mDNS on the bridge, left out with the same advice.
        found = prima(["nodes", "--json", "--mdns-interface", lan.host_ip, "--expect", "1"], env=env)
        assert [n["address"] for n in json.loads(found.stdout)["nodes"]] == [address], found.stderr
        flags = ["--mdns-interface", lan.host_ip, "--discover-timeout", "5", "--expect", "1"]
        advertised = prima(["run", *base, "-p", "secret prompt", "-n", "2", *flags], env=env)
        assert advertised.returncode != 0
        assert "prima cluster init" in advertised.stderr, advertised.stderr
        planned = prima(["plan", *base, *flags], env=env)
        assert planned.returncode != 0
        assert "prima cluster init" in planned.stderr, planned.stderr
        # Nothing reached the rogue: it holds no plan (and so never ran a Generate).
        client = NodeClient(address, identity="plaintext")
        try:
            assert client.info().plan_epoch == 0
        finally:
            client.close()
    finally:
        rogue.stop()
