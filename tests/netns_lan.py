"""A home LAN in network namespaces, for tests that need devices at non-loopback addresses: a
bridge as the router (this host's side holds .1), and one namespace per device on it, each with
its own address and, if asked, its own host name (a UTS namespace per process started).

Every address is in a random 10.x.y.0/24 no route of this host uses, so the tests' traffic
stays inside the namespaces they made. Needs root and `ip netns`; `skip_reason()` says why not.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


def skip_reason() -> str | None:
    """Why this machine cannot make a LAN of namespaces, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2, util-linux)"
    probe = f"pprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps no route of this host."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    used = []
    for line in routes.splitlines():
        try:
            used.append(ipaddress.ip_network(line.split()[0], strict=False))
        except ValueError:
            continue  # "default" and the like
    for _ in range(64):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for a test LAN")


@dataclass
class Device:
    """One namespace on the LAN: its name for `ip netns`, its address, and its host name."""

    netns: str
    ip: str
    hostname: str

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside this device's namespace, under its own host name."""
        return [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *cmd,
        ]


@dataclass
class Lan:
    """A bridge and the devices on it; `add` puts one more namespace on the bridge."""

    tag: str
    subnet: ipaddress.IPv4Network
    bridge: str
    host_ip: str
    devices: list[Device] = field(default_factory=list)

    def add(self, hostname: str) -> Device:
        n = len(self.devices)
        netns, outer, inner = f"pn{self.tag}{n}", f"pv{self.tag}{n}", f"pi{self.tag}{n}"
        ip = str(self.subnet.network_address + 2 + n)
        _ip("netns", "add", netns)
        device = Device(netns, ip, hostname)
        self.devices.append(device)  # cleaned up from here on
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("link", "set", inner, "netns", netns)
        inside = ("netns", "exec", netns, "ip")
        _ip(*inside, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", inner)
        _ip(*inside, "link", "set", inner, "up")
        _ip(*inside, "link", "set", "lo", "up")
        return device


@contextmanager
def home_lan() -> Iterator[Lan]:
    """A bridge with this host at .1; namespaces added with `Lan.add`; all removed on exit."""
    tag = secrets.token_hex(3)
    subnet = _free_subnet()
    lan = Lan(tag, subnet, f"pb{tag}", str(subnet.network_address + 1))
    _ip("link", "add", lan.bridge, "type", "bridge")
    try:
        _ip("addr", "add", f"{lan.host_ip}/{subnet.prefixlen}", "dev", lan.bridge)
        _ip("link", "set", lan.bridge, "up")
        yield lan
    finally:
        for device in lan.devices:
            subprocess.run(["ip", "netns", "del", device.netns], capture_output=True, check=False)
            subprocess.run(
                ["ip", "link", "del", f"pv{tag}{lan.devices.index(device)}"], capture_output=True, check=False
            )
        subprocess.run(["ip", "link", "del", lan.bridge], capture_output=True, check=False)
