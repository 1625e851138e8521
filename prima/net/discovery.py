"""Finding daemons on the LAN over mDNS / DNS-SD (service `_prima._tcp.local.`).

Each primad registers one service instance whose SRV/A records carry host:port and whose TXT
record carries its node id, protocol version and model fingerprint; the coordinator browses for
a few seconds. The pure half (TXT encode/decode into a frozen NodeAdvert, consistency checks) is
separate from the zeroconf half (Advertiser, browse, AdvertWatch), so the rules are tested without sockets.

TXT records come from anyone on the network: decoding trusts nothing, a malformed record raises
AdvertError, and browse skips it with a warning logged once per peer (then at debug level).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from types import TracebackType

import psutil
from zeroconf import (
    BadTypeInNameException,
    InterfaceChoice,
    InterfacesType,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from prima.errors import InputError, NodeError, PlanError
from prima.net.mdns_names import DEFAULT_BROWSE_S, INTERFACES_ENV, SERVICE_TYPE, SERVICE_TYPE_ENV
from prima.net.node_adverts import (
    MAX_NODE_ID_BYTES,
    AdvertError,
    NodeAdvert,
    debug_once,
    decode_txt,
    encode_txt,
    rank_hosts,
    require_consistent,
    warn_once,
)

log = logging.getLogger("prima.net")

_INSTANCE_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+-]")
_HOST_UNSAFE = re.compile(r"[^a-z0-9-]")


# -- interfaces ----------------------------------------------------------------------------------
def resolve_interfaces(interfaces: Sequence[str] | str | None = None) -> InterfacesType:
    """What to bind zeroconf to: explicit IPs, else $PRIMA_MDNS_INTERFACES (comma-separated IPs or
    'all'), else every interface. The variable lets tests tell subprocess daemons to use loopback."""
    if interfaces is None:
        interfaces = os.environ.get(INTERFACES_ENV, "")
    if isinstance(interfaces, str):
        interfaces = [s.strip() for s in interfaces.split(",") if s.strip()]
    if not interfaces or [s.lower() for s in interfaces] == ["all"]:
        return InterfaceChoice.All
    for ip in interfaces:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise InputError(
                f"mDNS interface {ip!r} is not an IP address; give this device's address on the LAN "
                f"(e.g. 192.168.1.20) or 'all' (in --interface or ${INTERFACES_ENV})"
            ) from None
    return list(interfaces)


def advertised_addresses(host: str, interfaces: InterfacesType) -> list[str]:
    """The addresses to publish for a daemon listening on `host`: that host itself, or for a
    wildcard the chosen interfaces, or every non-loopback IPv4 address of this device."""
    if host not in ("", "0.0.0.0", "::"):
        return [host]
    if isinstance(interfaces, list):
        return [str(i) for i in interfaces]
    found = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    return found or ["127.0.0.1"]


# -- the zeroconf half ---------------------------------------------------------------------------
def resolve_service_type(service_type: str | None = None) -> str:
    """The DNS-SD type to use: the argument, else $PRIMA_MDNS_SERVICE, else SERVICE_TYPE."""
    return service_type or os.environ.get(SERVICE_TYPE_ENV) or SERVICE_TYPE


def _instance_name(node_id: str, tag: str) -> str:
    """A DNS-SD instance label (<= 63 bytes): the node id plus a random tag. zeroconf's probe does
    not reliably catch two daemons claiming one name, and a clash would hide one of them; with
    unique names both are seen and a shared node id is reported instead."""
    base = _INSTANCE_UNSAFE.sub("-", node_id).strip(".-")[: MAX_NODE_ID_BYTES - len(tag) - 1] or "primad"
    return f"{base}-{tag}"


def _server_name(hostname: str, port: int, tag: str) -> str:
    """The host name of a daemon's address records (`<label>.local.`): this device's host name
    and port for people, plus the instance's random tag. Host names are not unique at home
    (every Android phone is `localhost`, every Raspberry Pi `raspberrypi`): without the tag,
    daemons on such devices would share one address record and all resolve to one address."""
    base = _HOST_UNSAFE.sub("-", f"prima-{hostname}-{port}".lower())[: MAX_NODE_ID_BYTES - len(tag) - 1]
    return f"{base}-{tag}"


class Advertiser:
    """Publishes one daemon while the context is open; leaving it sends the mDNS goodbye so
    browsers drop the node at once instead of after the record's TTL.

    Registration takes under a second (three announcements). Two daemons with the same node id
    both get published under distinct instance names, so browsers can report the clash.
    """

    def __init__(
        self,
        advert: NodeAdvert,
        *,
        interfaces: Sequence[str] | str | None = None,
        service_type: str | None = None,
    ) -> None:
        self.advert = advert
        self.interfaces = resolve_interfaces(interfaces)
        self.service_type = resolve_service_type(service_type)
        self._zc: Zeroconf | None = None
        self._info: ServiceInfo | None = None

    def __enter__(self) -> Advertiser:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def instance(self) -> str:
        """The registered DNS-SD instance name, or '' when not registered."""
        return self._info.name if self._info else ""

    def start(self) -> None:
        """Register the service; NodeError (with what to do) if mDNS cannot be used here."""
        a = self.advert
        try:
            txt = encode_txt(a)
        except AdvertError as exc:
            raise InputError(
                f"cannot advertise node {a.node_id[:40]!r}: {exc}; pick another --name"
            ) from None
        addresses = advertised_addresses(a.host, self.interfaces)
        tag = secrets.token_hex(3)
        server = _server_name(socket.gethostname(), a.port, tag)
        try:
            info = ServiceInfo(
                self.service_type,
                f"{_instance_name(a.node_id, tag)}.{self.service_type}",
                port=a.port,
                properties=txt,
                server=f"{server}.local.",
                parsed_addresses=addresses,
            )
            self._zc = Zeroconf(interfaces=self.interfaces)
            # The random tag makes the name unique already, so skip the ~1.5 s conflict probe
            # (cooperating_responders): primad is discoverable sooner after it starts.
            self._zc.register_service(info, cooperating_responders=True)
        except (OSError, BadTypeInNameException) as exc:
            self.close()
            raise NodeError(
                f"cannot advertise node {a.node_id} over mDNS ({exc}); start primad with --no-mdns "
                "and give the coordinator --nodes host:port,..."
            ) from exc
        self._info = info
        log.info("advertising %s at %s over mDNS as %r", a.node_id, ", ".join(addresses), info.name)

    def close(self) -> None:
        """Unregister (sending goodbyes) and close the sockets; safe to call twice."""
        zc, info = self._zc, self._info
        self._zc = self._info = None
        if zc is None:
            return
        try:
            if info is not None:
                zc.unregister_service(info)
        finally:
            zc.close()


# A browse considers at most this many instance names: more is a flood, not a home's devices.
MAX_INSTANCES = 256
# Address and TXT requests in flight at once (each waits up to RESOLVE_WAIT_MS on zeroconf's loop).
MAX_RESOLVING = 32
RESOLVE_WAIT_MS = 1000


class _Instances:
    """The instances of one service type a browser has seen, resolved as they come: from
    zeroconf's cache when their records came with the announcement (the usual case), else by a
    request run on zeroconf's own loop, up to MAX_RESOLVING at once. Nothing waits on one
    instance, so adverts that never send an address, or send garbage, cannot delay the others;
    each is skipped and logged once. Past MAX_INSTANCES names, new ones are skipped."""

    def __init__(self, zc: Zeroconf, service_type: str) -> None:
        self._zc, self._type = zc, service_type
        self._changed = threading.Condition()
        self._found: dict[str, NodeAdvert] = {}
        self._seen: set[str] = set()
        self._version: dict[str, int] = {}  # per name, bumped by every event: late answers lose
        self._waiting: deque[tuple[str, int]] = deque()
        self._resolving = 0
        self._closed = False
        self._browser = ServiceBrowser(zc, service_type, handlers=[self._on_change])

    def adverts(self) -> list[NodeAdvert]:
        """The instances resolved to a valid advert now, one per (node id, address)."""
        with self._changed:
            return _dedupe(self._found.values())

    def wait(self, timeout_s: float) -> None:
        """Until an advert comes or goes, or `timeout_s` passed."""
        with self._changed:
            self._changed.wait(timeout_s)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._waiting.clear()
        self._browser.cancel()

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        # Runs on the browser's own thread: nothing here blocks.
        with self._changed:
            if self._closed or (name not in self._seen and state_change == ServiceStateChange.Removed):
                return
            if name not in self._seen:
                if len(self._seen) >= MAX_INSTANCES:
                    warn_once(
                        f"flood:{self._type}",
                        "mDNS: over %d instances of %s are advertised (a flood?); skipping the rest",
                        MAX_INSTANCES,
                        self._type,
                    )
                    debug_once(f"over:{name}", "mDNS: skipping %r: over the instance cap", name)
                    return
                self._seen.add(name)
            version = self._version[name] = self._version.get(name, 0) + 1
            if state_change == ServiceStateChange.Removed:
                if self._found.pop(name, None) is not None:
                    self._changed.notify_all()
                return
        self._start(name, version)

    def _start(self, name: str, version: int) -> None:
        try:
            info = ServiceInfo(self._type, name)
        except BadTypeInNameException as exc:
            warn_once(f"name:{name}", "mDNS: skipping service %r: %s", name, exc)
            return
        if info.load_from_cache(self._zc):
            self._settle(name, version, info, answered=True)
            return
        with self._changed:
            if self._closed:
                return
            if self._resolving >= MAX_RESOLVING:
                self._waiting.append((name, version))
                return
            self._resolving += 1
        try:
            request = asyncio.run_coroutine_threadsafe(
                info.async_request(self._zc, RESOLVE_WAIT_MS), self._zc.loop
            )
        except RuntimeError:  # zeroconf is closing
            self._finish_one()
            return
        request.add_done_callback(lambda done: self._answered(name, version, info, done))

    def _answered(self, name: str, version: int, info: ServiceInfo, done: Future[bool]) -> None:
        answered = not done.cancelled() and done.exception() is None and bool(done.result())
        self._settle(name, version, info, answered)
        self._finish_one()

    def _finish_one(self) -> None:
        with self._changed:
            self._resolving -= 1
            if self._closed or not self._waiting:
                return
            name, version = self._waiting.popleft()
        self._start(name, version)

    def _settle(self, name: str, version: int, info: ServiceInfo, answered: bool) -> None:
        advert = _advert_of(name, info) if answered else None
        if not answered:
            warn_once(
                f"noanswer:{name}", "mDNS: %r did not send its address and TXT record; skipping it", name
            )
        with self._changed:
            if self._version.get(name) != version:
                return  # a later event for this name decides
            if advert is None:
                self._found.pop(name, None)
            else:
                self._found[name] = advert
            self._changed.notify_all()


def _advert_of(name: str, info: ServiceInfo) -> NodeAdvert | None:
    """The advert an instance's records make, or None (logged once) if they make none."""
    hosts = rank_hosts(info.parsed_scoped_addresses())
    if not hosts or info.port is None:
        warn_once(f"noaddr:{name}", "mDNS: %r advertises no usable address; skipping it", name)
        return None
    try:
        advert = decode_txt(info.properties, hosts[0], info.port, instance=name)
    except AdvertError as exc:
        warn_once(f"txt:{name}", "mDNS: skipping %r at %s:%d: %s", name, hosts[0], info.port, exc)
        return None
    return dataclasses.replace(advert, hosts=tuple(hosts))


def _open_zeroconf(interfaces: Sequence[str] | str | None, what: str) -> Zeroconf:
    try:
        return Zeroconf(interfaces=resolve_interfaces(interfaces))
    except OSError as exc:
        raise NodeError(f"cannot open mDNS sockets ({exc}); {what}") from exc


def browse(
    timeout_s: float = DEFAULT_BROWSE_S,
    *,
    interfaces: Sequence[str] | str | None = None,
    expect: int | None = None,
    service_type: str | None = None,
    enough: Callable[[list[NodeAdvert]], bool] | None = None,
) -> list[NodeAdvert]:
    """The daemons that answer within `timeout_s`, sorted by node id; returns as soon as
    adverts of `expect` node ids are in, or `enough(adverts)` says so (asked whenever the
    adverts change and a few times a second: it must not block). Malformed, address-less or
    surplus instances are skipped with a warning. `service_type` lets tests browse a private type."""
    if enough is None:
        enough = (
            (lambda _: False) if expect is None else (lambda found: len({a.node_id for a in found}) >= expect)
        )
    service_type = resolve_service_type(service_type)
    deadline = time.monotonic() + timeout_s
    zc = _open_zeroconf(interfaces, "pass --nodes host:port,... instead of discovering")
    instances = _Instances(zc, service_type)
    try:
        # By default count node ids, not adverts: an advert that clashes with a node's id must
        # not end the search before the genuine nodes are in.
        while not enough(instances.adverts()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            instances.wait(min(remaining, 0.25))
        adverts = instances.adverts()
    finally:
        instances.close()
        zc.close()
    log.info("mDNS browse found %d node(s): %s", len(adverts), ", ".join(a.node_id for a in adverts))
    return adverts


class AdvertWatch:
    """Browses for as long as it is open and keeps the adverts seen, for a coordinator that may
    re-plan at any moment: a daemon that (re)starts announces itself and is known within a
    moment, instead of after a browse window the re-plan would have to wait out."""

    def __init__(
        self, *, interfaces: Sequence[str] | str | None = None, service_type: str | None = None
    ) -> None:
        self.service_type = resolve_service_type(service_type)
        self._zc = _open_zeroconf(interfaces, "nodes that come back are not found")
        self._instances = _Instances(self._zc, self.service_type)
        self._closed = False

    def adverts(self) -> list[NodeAdvert]:
        """The daemons advertised now, sorted by node id."""
        return self._instances.adverts()

    def close(self) -> None:
        """Stop browsing and close the sockets; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._instances.close()
        self._zc.close()


def _dedupe(adverts: Iterable[NodeAdvert]) -> list[NodeAdvert]:
    """One entry per (node id, address): a daemon seen under two instance names (a restart whose
    old record is still cached) is one node, not a duplicate-id clash."""
    unique: dict[tuple[str, str], NodeAdvert] = {}
    for a in sorted(adverts, key=lambda a: (a.node_id, a.address, a.instance)):
        unique.setdefault((a.node_id, a.address), a)
    return list(unique.values())


def discover(
    timeout_s: float = DEFAULT_BROWSE_S,
    *,
    interfaces: Sequence[str] | str | None = None,
    expect: int | None = None,
    model_fingerprint: str | None = None,
    service_type: str | None = None,
) -> list[NodeAdvert]:
    """Browse, then insist the nodes can form one ring: the coordinator's entry point. Raises
    PlanError when nothing answered (naming the --nodes fallback) or on any Problem."""
    adverts = browse(timeout_s, interfaces=interfaces, expect=expect, service_type=service_type)
    if not adverts:
        raise PlanError(
            f"no primad answered over mDNS within {timeout_s:g} s; check the daemons run (without "
            "--no-mdns) on this network, or pass --nodes host:port,... (multicast is often blocked by "
            "Wi-Fi client isolation and in containers)"
        )
    return require_consistent(adverts, model_fingerprint=model_fingerprint)
