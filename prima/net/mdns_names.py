"""The names and defaults of prima's mDNS discovery (prima.net.discovery) that command-line flags
show: importable without zeroconf, so that a command run on one device never loads it."""

from __future__ import annotations

SERVICE_TYPE = "_prima._tcp.local."
INTERFACES_ENV = "PRIMA_MDNS_INTERFACES"
# A private service type (e.g. "_prima-t1._tcp.local.") keeps test rings apart from each other.
SERVICE_TYPE_ENV = "PRIMA_MDNS_SERVICE"
DEFAULT_BROWSE_S = 3.0
