"""A home LAN in network namespaces (tests/netns_lan.py): devices at non-loopback addresses,
each with its own host name, their daemons advertising over mDNS on the LAN's bridge.

- Secure by default: a coordinator without a cluster identity never sends a request to a
  plaintext daemon off loopback (named with --nodes or advertised), and says how to form a
  cluster.
- Devices that share a host name (every Android phone is `localhost`) and port are all found
  and all used."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from prima.net import credentials, discovery
from prima.net.client import NodeClient
from prima.net.credentials import ClusterCA
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


def test_devices_that_share_a_host_name_and_port_are_all_found_and_used(
    lan: Lan, smollm2_path: Path, tmp_path: Path
) -> None:
    """Three phones, each named `localhost`, each primad on the default port: each daemon's
    address record is its own, so a coordinator on a fourth device finds three addresses, and a
    ring over all three runs."""
    ca = ClusterCA.create("home")
    service = f"_pl{secrets.token_hex(3)}._tcp.local."
    phones = [lan.add("localhost") for _ in range(3)]
    laptop = lan.add("laptop")
    daemons = []
    try:
        for i, phone in enumerate(phones):
            own = tmp_path / f"phone{i}"
            own.mkdir()
            credentials.write_private(own / credentials.IDENTITY_FILE, ca.issue(f"phone{i}").to_pem())
            env = {credentials.CLUSTER_DIR_ENV: str(own), discovery.SERVICE_TYPE_ENV: service}
            daemons.append(start_primad(phone.ip, PORT, smollm2_path, tmp_path, env=env, wrap=phone.argv))
        here = tmp_path / "laptop"
        here.mkdir()
        credentials.write_private(
            here / credentials.IDENTITY_FILE, ca.issue("laptop", role="coordinator").to_pem()
        )
        env = {credentials.CLUSTER_DIR_ENV: str(here), discovery.SERVICE_TYPE_ENV: service}
        expected = {f"{p.ip}:{PORT}" for p in phones}
        browse = ["--mdns-interface", laptop.ip, "--discover-timeout", "20", "--expect", "3"]
        found = prima(["nodes", "--json", *browse], env=env, device=laptop)
        assert found.returncode == 0, found.stderr
        assert {n["address"] for n in json.loads(found.stdout)["nodes"]} == expected
        run = ["run", "-m", str(smollm2_path), "--ctx", "64", "-p", "Hello", "-n", "2", "--json"]
        ran = prima([*run, "--windows", "10,10,10", *browse], env=env, device=laptop)
        assert ran.returncode == 0, ran.stderr
        plan = json.loads(ran.stdout)["plan"]
        assert {n["address"] for n in plan["nodes"]} == expected
        assert sorted(n["node_id"] for n in plan["nodes"]) == ["phone0", "phone1", "phone2"]
    finally:
        for d in daemons:
            d.stop()
