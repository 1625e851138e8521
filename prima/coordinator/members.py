"""Finding this cluster's daemons over mDNS, where anyone on the LAN can advertise.

Adverts are hints: each advertised address is checked, once, with a TLS handshake of its own
(prima.net.peer_certificate) as it comes in, and only a daemon serving a node certificate of
this cluster counts, under the node id its certificate names. So `--expect N` waits for N
members, not N adverts: adverts that prove nothing (a clashing node id, an address where nobody
listens, a stranger's daemon) neither end the search nor get into its result.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prima.errors import NodeError, UntrustedNodeError
from prima.net import credentials, discovery
from prima.net.discovery import NodeAdvert
from prima.net.peer_certificate import served_certificate

from .loopback_only import usable_addresses

log = logging.getLogger("prima.coordinator")

CHECK_TIMEOUT_S = 3.0
MAX_CHECKS_AT_ONCE = 8


@dataclass(frozen=True)
class Found:
    """What a search found: every advert (for messages), the addresses worth connecting to, and
    the node ids behind them (from their certificates, or from the adverts on a plaintext
    coordinator, which has no way to check them)."""

    adverts: tuple[NodeAdvert, ...]
    addresses: tuple[str, ...]
    node_ids: frozenset[str]


def discover_members(
    timeout_s: float,
    *,
    interfaces: Sequence[str] | str | None = None,
    expect: int | None = None,
    model_fingerprint: str | None = None,
) -> Found:
    """Browse for up to `timeout_s` (less once `expect` members answered) and keep the addresses
    of daemons that prove membership; adverts for another model or protocol are left out."""
    identity = credentials.client_identity()
    if identity is None:  # plaintext: nothing can be checked, so only this machine's daemons
        adverts = discovery.browse(timeout_s, interfaces=interfaces, expect=expect)
        hints = discovery.hint_addresses(adverts, model_fingerprint=model_fingerprint)
        addresses = usable_addresses(hints, skip=True)
        ids = frozenset(a.node_id for a in adverts if a.address in addresses)
        return Found(tuple(adverts), tuple(addresses), ids)
    members: dict[str, str | None] = {}  # address -> node id, None for one that proved nothing

    def check_new(adverts: list[NodeAdvert]) -> None:
        hints = discovery.hint_addresses(adverts, model_fingerprint=model_fingerprint)
        others = {a.address: a.addresses for a in adverts}  # every address a daemon lists
        members.update(_members([a for a in hints if a not in members], identity, others))

    def enough(adverts: list[NodeAdvert]) -> bool:
        if not expect:
            return False
        check_new(adverts)
        return len({n for n in members.values() if n is not None}) >= expect

    adverts = discovery.browse(timeout_s, interfaces=interfaces, enough=enough)
    check_new(adverts)
    kept = {a: n for a, n in members.items() if n is not None}
    return Found(tuple(adverts), tuple(sorted(kept)), frozenset(kept.values()))


def _members(
    addresses: Sequence[str],
    identity: credentials.Identity,
    alternatives: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, str | None]:
    """{address: node id} of `addresses`: the name in the node certificate (of this device's
    cluster) its daemon serves, or None (logged) if it serves none. An address that does not
    answer is replaced by the first of its `alternatives` (the other addresses the same advert
    lists) that proves membership."""
    alternatives = alternatives or {}

    def check(address: str) -> tuple[str, str | None]:
        for candidate in dict.fromkeys([address, *alternatives.get(address, ())]):
            try:
                cert = served_certificate(candidate, identity.roots_pem, CHECK_TIMEOUT_S, client=identity)
            except UntrustedNodeError as exc:
                log.warning("mDNS: leaving out %s (not a member): %s", candidate, exc)
                return address, None
            except NodeError as exc:  # an advert outliving its daemon, or a dead-end address
                log.info("mDNS: no answer at %s: %s", candidate, exc)
                continue
            return candidate, credentials.cert_name(cert)
        return address, None

    if not addresses:
        return {}
    with ThreadPoolExecutor(min(len(addresses), MAX_CHECKS_AT_ONCE)) as pool:
        found = list(pool.map(check, addresses))
    checked: dict[str, str | None] = dict.fromkeys(addresses)  # checked, even if another answered
    checked.update(found)
    return checked
