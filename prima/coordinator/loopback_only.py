"""Secure by default: a coordinator without a cluster identity talks plaintext, so it can check
nothing about a daemon (anyone on the LAN can advertise one, or answer at an address); it uses
daemons on this machine (loopback) only, and says how to form a cluster for the others.

The choice is a pure function of the addresses (`split_loopback`); host names other than
`localhost` are resolved by the caller's resolver (the system's by default)."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence

from prima.errors import UntrustedNodeError
from prima.net import credentials

log = logging.getLogger("prima.coordinator")

FORM_A_CLUSTER = (
    "this device has no cluster identity, so it uses daemons on this machine (127.0.0.1) only: "
    "a daemon elsewhere could be anyone's, and would see your prompts. To use other devices, form "
    "a cluster: `prima cluster init` on one device, then `prima cluster invite NAME` there for each "
    "other device (`--role coordinator` for one that only runs prompts) and `prima cluster join "
    "--invite HOST:PORT/CODE` (or `primad --join ...`) on that device, as the invite says "
    "(docs/security.md)"
)

Resolver = Callable[[str], list[str]]


def system_resolver(host: str) -> list[str]:
    """The IP addresses `host` resolves to here ([] if it does not resolve)."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
    except (OSError, UnicodeError):
        return []


def is_loopback(address: str, resolve: Resolver = system_resolver) -> bool:
    """Whether every address the host of `address` ("host:port", IPv6 in brackets) names is a
    loopback one: 127.0.0.0/8, ::1, `localhost`, or a name that resolves only to those."""
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    host = host.split("%")[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True  # RFC 6761: always loopback, whatever a resolver says
    resolved = resolve(host)
    return bool(resolved) and all(_is_loopback_ip(ip) for ip in resolved)


def _is_loopback_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text.split("%")[0]).is_loopback
    except ValueError:
        return False


def split_loopback(
    addresses: Sequence[str], resolve: Resolver = system_resolver
) -> tuple[list[str], list[str]]:
    """(loopback addresses, the others), each in the order given."""
    near = [a for a in addresses if is_loopback(a, resolve)]
    return near, [a for a in addresses if a not in near]


_THIS_PROCESS = object()  # usable_addresses' default: the identity this process calls with


def usable_addresses(
    addresses: Sequence[str],
    *,
    skip: bool,
    identity: credentials.Identity | None | object = _THIS_PROCESS,
    resolve: Resolver = system_resolver,
) -> list[str]:
    """The addresses a caller with `identity` (default: this process's,
    credentials.client_identity()) may send requests to: all of them with one (mutual TLS checks
    each daemon), else only loopback ones. Without an identity, a non-loopback address is an
    UntrustedNodeError saying how to form a cluster, or with `skip` (addresses that are only
    hints, as mDNS adverts are) left out with a warning."""
    if identity is _THIS_PROCESS:
        identity = credentials.client_identity()
    if identity is not None:
        return list(addresses)
    near, far = split_loopback(addresses, resolve)
    if far and not skip:
        raise UntrustedNodeError(f"refusing to use {', '.join(far)}: {FORM_A_CLUSTER}")
    new = [a for a in far if a not in _warned]
    if new:
        _warned.update(new)
        log.warning("leaving out %s: %s", ", ".join(new), FORM_A_CLUSTER)
    elif far:  # a re-plan or another browse: said already
        log.debug("leaving out %s (no cluster identity)", ", ".join(far))
    return near


_warned: set[str] = set()  # addresses already reported: re-plans repeat them
