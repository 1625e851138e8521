"""How the coordinator looks for its members over mDNS, as options a command line sets: light to
import, where prima.coordinator.members, which does the looking, loads zeroconf and TLS."""

from __future__ import annotations

from dataclasses import dataclass

from prima.net import mdns_names


@dataclass(frozen=True)
class Discovery:
    """How to look for daemons over mDNS: for `timeout_s`, on `interfaces` (None: the
    environment's, else all), stopping once `expect` members answered (fewer is then an error):
    prima.coordinator.members.discover_addresses."""

    timeout_s: float = mdns_names.DEFAULT_BROWSE_S
    interfaces: tuple[str, ...] | None = None
    expect: int | None = None
