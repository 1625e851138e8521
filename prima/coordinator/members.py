"""Finding this cluster's daemons over mDNS, where anyone on the LAN can advertise.

Adverts are hints: each advertised address is checked, once, with a TLS handshake of its own
(prima.net.peer_certificate) as it comes in, in the background (MAX_CHECKS_AT_ONCE at a time),
and only a daemon serving a node certificate of this cluster counts, under the node id its
certificate names. So `--expect N` waits for N members, not N adverts: adverts that prove
nothing (a clashing node id, an address where nobody listens, a stranger's daemon) neither end
the search, nor delay it, nor get into its result. Each advert ends marked (`Check`): a member,
not a member, or unverified (nothing answered, its check did not finish, or this device has no
identity to check with).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from prima.errors import NodeError, PlanError, UntrustedNodeError
from prima.net import credentials, discovery
from prima.net.node_adverts import NodeAdvert, check_adverts, hint_addresses
from prima.net.peer_certificate import served_certificate

from .discovery_options import Discovery
from .loopback_only import FORM_A_CLUSTER, split_loopback, usable_addresses

log = logging.getLogger("prima.coordinator")

CHECK_TIMEOUT_S = 3.0
MAX_CHECKS_AT_ONCE = 8

Verdict = Literal["member", "not a member", "unverified"]


@dataclass(frozen=True)
class Check:
    """What an advert proved. `address` is the one that answered (the advert's own if none did),
    `node_id` the name in a member's certificate, `reason` why it is not a member or unverified."""

    verdict: Verdict
    address: str
    node_id: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class Found:
    """What a search found: every advert (for messages), the addresses worth connecting to, the
    node ids behind them (from their certificates, or from the adverts on a plaintext
    coordinator, which has no way to check them), and each advert's check by its address."""

    adverts: tuple[NodeAdvert, ...]
    addresses: tuple[str, ...]
    node_ids: frozenset[str]
    checks: Mapping[str, Check] = field(default_factory=dict)

    def check(self, advert: NodeAdvert) -> Check:
        """The advert's check (unverified if it was never checked: another model or protocol)."""
        return self.checks.get(advert.address) or Check("unverified", advert.address, reason="not checked")


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
    if identity is None:
        return _plaintext(timeout_s, interfaces, expect, model_fingerprint)
    checks = MemberChecks(identity)

    def check_new(adverts: list[NodeAdvert]) -> None:
        hints = set(hint_addresses(adverts, model_fingerprint=model_fingerprint))
        for a in adverts:
            if a.address in hints:
                checks.submit(a.address, a.addresses)

    def enough(adverts: list[NodeAdvert]) -> bool:
        check_new(adverts)  # only starts checks: the browse goes on while they run
        return bool(expect) and len(set(checks.members().values())) >= expect

    try:
        adverts = discovery.browse(timeout_s, interfaces=interfaces, enough=enough)
        check_new(adverts)
        # Checks under way finish (each is bounded); with `expect` met, the quick ones at least.
        checks.wait(time.monotonic() + CHECK_TIMEOUT_S)
    finally:
        checks.close()
    kept = checks.members()
    return Found(tuple(adverts), tuple(sorted(kept)), frozenset(kept.values()), checks.results())


def _plaintext(
    timeout_s: float,
    interfaces: Sequence[str] | str | None,
    expect: int | None,
    model_fingerprint: str | None,
) -> Found:
    """Without an identity nothing can be checked, so only this machine's daemons are used
    (and counted by `expect`); every advert is unverified."""

    def near_ids(adverts: list[NodeAdvert]) -> set[str]:
        near, _ = split_loopback([a.address for a in adverts], resolve=lambda _: [])
        return {a.node_id for a in adverts if a.address in near}

    def enough(adverts: list[NodeAdvert]) -> bool:
        return bool(expect) and len(near_ids(adverts)) >= expect

    adverts = discovery.browse(timeout_s, interfaces=interfaces, enough=enough)
    hints = hint_addresses(adverts, model_fingerprint=model_fingerprint)
    addresses = usable_addresses(hints, skip=True)
    ids = frozenset(a.node_id for a in adverts if a.address in addresses)
    why = {
        True: "no cluster identity here to check it with (a daemon on this machine: used)",
        False: "no cluster identity here to check it with (not on this machine: not used)",
    }
    checks = {a.address: Check("unverified", a.address, reason=why[a.address in addresses]) for a in adverts}
    return Found(tuple(adverts), tuple(addresses), ids, checks)


class MemberChecks:
    """Membership checks of advertised addresses, run in the background on a bounded pool: each
    address once, trying the other addresses its advert lists when it does not answer."""

    def __init__(self, identity: credentials.Identity, max_at_once: int = MAX_CHECKS_AT_ONCE) -> None:
        self._identity = identity
        self._pool = ThreadPoolExecutor(max_at_once, thread_name_prefix="prima-member-check")
        self._futures: dict[str, Future[Check]] = {}

    def submit(self, address: str, alternatives: Sequence[str] = ()) -> None:
        """Start checking `address` (then `alternatives`) unless it was already."""
        if address not in self._futures:
            self._futures[address] = self._pool.submit(check_member, address, self._identity, alternatives)

    def results(self) -> dict[str, Check]:
        """The check of each submitted address, unverified for one still under way."""
        return {
            a: f.result()
            if f.done() and not f.cancelled()
            else Check("unverified", a, reason="check did not finish")
            for a, f in self._futures.items()
        }

    def members(self) -> dict[str, str]:
        """{address that answered: node id} of the members found so far."""
        return {
            c.address: c.node_id
            for c in self.results().values()
            if c.verdict == "member" and c.node_id is not None
        }

    def wait(self, until: float) -> None:
        """Until every check finished, or the monotonic time `until`."""
        for f in list(self._futures.values()):
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            try:
                f.result(timeout=remaining)
            except TimeoutError:
                return

    def close(self) -> None:
        """Drop the checks not yet started; those running end within their own timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_member(address: str, identity: credentials.Identity, alternatives: Sequence[str] = ()) -> Check:
    """Whether the daemon at `address` (else at the first of `alternatives`, the other addresses
    its advert lists, that answers) serves a node certificate of this device's cluster."""
    for candidate in dict.fromkeys([address, *alternatives]):
        try:
            cert = served_certificate(candidate, identity.roots_pem, CHECK_TIMEOUT_S, client=identity)
        except UntrustedNodeError as exc:
            log.warning("mDNS: leaving out %s (not a member): %s", candidate, exc)
            return Check("not a member", candidate, reason=str(exc))
        except NodeError as exc:  # an advert outliving its daemon, or a dead-end address
            log.info("mDNS: no answer at %s: %s", candidate, exc)
            continue
        return Check("member", candidate, credentials.cert_name(cert))
    return Check("unverified", address, reason="nothing answered at the address it advertises")


def discover_addresses(
    how: Discovery, fingerprint: str | None, on_stage: Callable[[str], None] = log.warning
) -> list[str]:
    """The addresses of the cluster's daemons that answered over mDNS ([] if none did): adverts
    are hints, kept only when the daemon proves membership at a handshake. PlanError if fewer
    than `how.expect` node ids answered; `on_stage` hears why adverts found were of no use."""
    found = discover_members(
        how.timeout_s, interfaces=how.interfaces, expect=how.expect, model_fingerprint=fingerprint
    )
    if how.expect and len(found.node_ids) < how.expect:
        shown = ", ".join(f"{a.node_id} at {a.address}" for a in found.adverts)
        clashes = [p.message for p in check_adverts(found.adverts) if p.kind == "duplicate_id"]
        advice = (
            "; ".join(clashes)
            or _far_advice(found.adverts)
            or (
                "start the others or pass --nodes host:port,... (multicast is often blocked by Wi-Fi "
                "client isolation and in containers)"
            )
        )
        raise PlanError(
            f"{len(found.node_ids)} member(s) answered within {how.timeout_s:g} s (adverts: "
            f"{shown or 'none'}), expected {how.expect}; {advice}"
        )
    if found.adverts and not found.addresses and (advice := _far_advice(found.adverts)):
        on_stage(f"no daemon found over mDNS can be used: {advice}")
    return list(found.addresses)


def _far_advice(adverts: Sequence[NodeAdvert]) -> str:
    """How to form a cluster, when this device has no identity and daemons elsewhere advertised
    (which such a device never uses); else ''."""
    if credentials.client_identity() is not None:
        return ""
    _, far = split_loopback([a.address for a in adverts], resolve=lambda _: [])
    return FORM_A_CLUSTER if far else ""
