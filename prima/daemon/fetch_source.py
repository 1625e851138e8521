"""Where a daemon without the model file gets its header at start (`primad --fetch-from`): the
daemon named, or with `mdns` each daemon advertising the whole file in turn. Adverts are hints
(anyone on the LAN can claim to hold the file): a holder that fails the TLS check is skipped
with a line saying so, and the next one is tried. A source that is not up yet (still compiling,
or not started) is waited for, up to a deadline, with a progress line now and then.

The loop (`first_source`) takes its candidates, its attempt, the clock and sleep as arguments,
so its rules are tested without daemons or waiting."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from prima.errors import NodeError, UntrustedNodeError
from prima.model.sparse import SparseFile
from prima.net import credentials, discovery
from prima.net.client import NodeClient
from prima.net.codec import PROTOCOL_VERSION
from prima.net.fetch import bootstrap
from prima.net.node_adverts import NodeAdvert
from prima.net.peer_certificate import served_certificate

log = logging.getLogger("prima.daemon")

DEFAULT_FETCH_WAIT_S = 600.0
RETRY_S = 2.0  # between rounds of attempts at sources that did not answer
PROGRESS_EVERY_S = 15.0
CHECK_TIMEOUT_S = 3.0

T = TypeVar("T")


def first_source(
    candidates: Callable[[], Sequence[str]],
    attempt: Callable[[str], T],
    *,
    wait_s: float,
    progress: Callable[[str], None],
    more_may_come: bool,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[T, str]:
    """(attempt(address), address) of the first candidate whose attempt succeeds. A candidate
    that fails the TLS check (UntrustedNodeError) is never tried again; one that does not answer
    (NodeError) is tried again each round, until `wait_s` has passed. Without `more_may_come`
    (a source named by hand) a refused source ends the search at once."""
    deadline = clock() + wait_s
    refused: dict[str, str] = {}
    silent: dict[str, str] = {}  # address -> why it did not answer, last time
    next_progress = clock() + RETRY_S  # a source coming up in a moment needs no line
    while True:
        for address in candidates():
            if address in refused:
                continue
            try:
                return attempt(address), address
            except UntrustedNodeError as exc:
                refused[address] = str(exc)
                silent.pop(address, None)
                progress(
                    f"skipping {address}: it failed the TLS check, so it is not a member of this cluster"
                )
                log.info("%s", exc)
                if not more_may_come:
                    raise
            except NodeError as exc:
                silent[address] = str(exc)
        now = clock()
        if now >= deadline:
            raise NodeError(_gave_up(wait_s, refused, silent))
        if now >= next_progress:
            waiting = ", ".join(silent) or "a primad advertising the whole model file"
            progress(
                f"waiting for {waiting} to answer (not listening yet?); giving up in "
                f"{deadline - now:.0f} s (--fetch-wait)"
            )
            next_progress = now + PROGRESS_EVERY_S
        sleep(min(RETRY_S, deadline - now))


def _gave_up(wait_s: float, refused: dict[str, str], silent: dict[str, str]) -> str:
    parts = [f"{a} did not answer ({why})" for a, why in silent.items()]
    parts += [f"{a} is not a member of this cluster" for a in refused]
    seen = "; ".join(parts) or "no primad on this network advertised the whole model file"
    return (
        f"found no source for the model within {wait_s:g} s (--fetch-wait): {seen}; start a primad "
        "with the file (it advertises itself once ready), or pass --fetch-from HOST:PORT"
    )


def fetch_header(
    path: Path,
    *,
    named: str | None,
    identity: credentials.Identity | None,
    interfaces: Sequence[str] | str | None,
    wait_s: float,
    progress: Callable[[str], None],
) -> tuple[SparseFile, str]:
    """`path` made a sparse copy (header at least) of the model a source serves, and that
    source's address: `named`, else (None) the daemons advertising the whole file over mDNS."""
    if named is not None:
        return first_source(
            lambda: [named],
            lambda a: _bootstrap_from(path, a, identity),
            wait_s=wait_s,
            progress=progress,
            more_may_come=False,
        )
    tried: set[str] = set()

    def advertised() -> list[str]:
        adverts = discovery.browse(
            interfaces=interfaces,
            enough=lambda found: any(a.address not in tried for a in fetch_sources(found)),
        )
        holders = fetch_sources(adverts)
        if len({a.model_fingerprint for a in holders}) > 1 and not tried:
            which = ", ".join(f"{a.node_id} at {a.address} ({a.short_fingerprint})" for a in holders)
            log.warning(
                "daemons advertising different model files: %s; trying the most common first (pass "
                "--fetch-from HOST:PORT to choose)",
                which,
            )
        tried.update(a.address for a in holders)
        return [a.address for a in holders]

    return first_source(
        advertised,
        lambda a: _bootstrap_from(path, a, identity),
        wait_s=wait_s,
        progress=progress,
        more_may_come=True,
    )


def fetch_sources(adverts: Sequence[NodeAdvert]) -> list[NodeAdvert]:
    """The adverts to try fetching from, in order: daemons of this protocol advertising the whole
    file, the model most of them advertise first."""
    holders = [a for a in adverts if a.holds_full_file and a.protocol_version == PROTOCOL_VERSION]
    counts: dict[str, int] = {}
    for a in holders:
        counts[a.model_fingerprint] = counts.get(a.model_fingerprint, 0) + 1
    return sorted(holders, key=lambda a: (-counts[a.model_fingerprint], a.node_id, a.address))


def _bootstrap_from(path: Path, address: str, identity: credentials.Identity | None) -> SparseFile:
    """The header fetched from `address`, after checking (with an identity) that a member of
    this cluster serves there: UntrustedNodeError if not, NodeError if nothing answers."""
    if identity is not None:
        served_certificate(address, identity.roots_pem, CHECK_TIMEOUT_S, client=identity)
    source = NodeClient(address, identity=identity or "plaintext")
    try:
        return bootstrap(path, source)
    finally:
        source.close()
