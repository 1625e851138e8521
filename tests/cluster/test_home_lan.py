"""A home LAN in network namespaces (tests/netns_lan.py): devices at non-loopback addresses,
each with its own host name, their daemons advertising over mDNS on the LAN's bridge.

- Secure by default: a coordinator without a cluster identity never sends a request to a
  plaintext daemon off loopback (named with --nodes or advertised), and says how to form a
  cluster."""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from prima.coordinator.local_ring import READY_PREFIX
from prima.net import discovery
from prima.net.client import NodeClient
from tests.netns_lan import Device, Lan, home_lan, skip_reason

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


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    ready: dict[str, object]
    stderr: Path

    def stop(self) -> str:
        """Stop it (SIGTERM, then SIGKILL) and return what it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        return self.stderr.read_text(errors="replace")


def start_primad(
    device: Device, model: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None
) -> Daemon:
    """primad in `device`'s namespace on its address and port 7000, advertising on that address;
    returns once it printed its ready line (fails the test with its stderr otherwise)."""
    stderr = log_dir / f"primad-{device.netns}-{secrets.token_hex(2)}.err"
    cmd = [sys.executable, "-m", "prima.cli.primad", "--host", device.ip, "--port", str(PORT)]
    cmd += ["--model", str(model), "--threads", "1", *args]
    full_env = {**os.environ, discovery.INTERFACES_ENV: device.ip, **(env or {})}
    with stderr.open("w") as err:
        proc = subprocess.Popen(device.argv(cmd), env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith(READY_PREFIX):
            return Daemon(proc, json.loads(line[len(READY_PREFIX) :]), stderr)
    daemon = Daemon(proc, {}, stderr)
    pytest.fail(f"primad in {device.netns} did not start: {daemon.stop()[-3000:]}")


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
    rogue = start_primad(rogue_device, smollm2_path, tmp_path, "--insecure", env=env)
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
