"""What a daemon's mDNS advert says, and which adverts can form a ring: the pure half of
discovery (prima.net.discovery is the zeroconf half), so the rules are tested without sockets.

Each primad's TXT record carries its node id, protocol version and model fingerprint. TXT records
come from anyone on the network: decoding trusts nothing, and a malformed record raises
AdvertError.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prima.errors import PlanError, ProtocolError
from prima.net.codec import PROTOCOL_VERSION

log = logging.getLogger("prima.net")

SHORT_FINGERPRINT = 12  # hex digits shown to people, as the coordinator's messages do

# TXT limits: a DNS label holds at most 63 bytes, and DNS-SD advises keeping the whole TXT
# record small enough for one packet. Anything larger is noise or an attack, not a daemon.
MAX_NODE_ID_BYTES = 63
MAX_MODEL_NAME_BYTES = 120
MAX_TXT_BYTES = 1024
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{8,128}")
_INSTANCE_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+-]")
_HOST_UNSAFE = re.compile(r"[^a-z0-9-]")

# TXT keys. Unknown keys are ignored so newer daemons can add fields.
K_ID, K_PROTO, K_FINGERPRINT, K_MODEL = "id", "proto", "fingerprint", "model"
K_FULL = "full"  # "1": the daemon holds every byte of its model file (a source to fetch from)
REQUIRED_KEYS = (K_ID, K_PROTO, K_FINGERPRINT)


class AdvertError(ProtocolError):
    """A TXT record is missing a key, not UTF-8, oversized or has an unusable value."""


# -- the pure half -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeAdvert:
    """One daemon as seen over mDNS: who it is (TXT) and where it listens (SRV + A records)."""

    node_id: str
    host: str
    port: int
    model_fingerprint: str
    model_name: str = ""
    protocol_version: int = PROTOCOL_VERSION
    instance: str = ""  # the DNS-SD instance name; unique on the LAN even when node ids clash
    # A hint for nodes without the file: what it sends is checked against hashes and the
    # fingerprint anyway, over mutual TLS.
    holds_full_file: bool = False
    # Every address the daemon's records list, best first (`host` is the first): a device with
    # several interfaces may be reachable on only some of them from here.
    hosts: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        """host:port for a gRPC channel (IPv6 hosts in brackets)."""
        return _host_port(self.host, self.port)

    @property
    def addresses(self) -> tuple[str, ...]:
        """host:port of every address advertised, best first (just `address` if none listed)."""
        return tuple(_host_port(h, self.port) for h in self.hosts) or (self.address,)

    @property
    def short_fingerprint(self) -> str:
        return self.model_fingerprint[:SHORT_FINGERPRINT]


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def encode_txt(advert: NodeAdvert) -> dict[str, str]:
    """The TXT properties a daemon publishes; checked with the same rules decode applies, so a
    daemon cannot advertise something every browser would then drop."""
    props = {
        K_ID: advert.node_id,
        K_PROTO: str(advert.protocol_version),
        K_FINGERPRINT: advert.model_fingerprint,
        K_MODEL: _clip_model_name(advert.model_name),
        K_FULL: "1" if advert.holds_full_file else "0",
    }
    decode_txt({k.encode(): v.encode() for k, v in props.items()}, advert.host, advert.port)
    return props


def _clip_model_name(name: str) -> str:
    """The model name is only shown to people: drop what browsers would reject rather than refuse
    to advertise a daemon over a long GGUF `general.name`."""
    clean = "".join(c for c in name if c.isprintable())
    return clean.encode()[:MAX_MODEL_NAME_BYTES].decode("utf-8", errors="ignore")


def decode_txt(
    properties: Mapping[bytes, bytes | None], host: str, port: int, instance: str = ""
) -> NodeAdvert:
    """A NodeAdvert from a peer's TXT properties and resolved address, or AdvertError saying why not."""
    size = sum(len(k) + len(v or b"") + 2 for k, v in properties.items())
    if size > MAX_TXT_BYTES:
        raise AdvertError(f"TXT record of {size} bytes is over the {MAX_TXT_BYTES}-byte limit")
    text: dict[str, str] = {}
    for key, value in properties.items():
        try:
            text[key.decode("ascii").lower()] = (value or b"").decode("utf-8")
        except UnicodeDecodeError:
            raise AdvertError(f"TXT key {key[:20]!r} or its value is not valid text") from None
    missing = [k for k in REQUIRED_KEYS if not text.get(k)]
    if missing:
        raise AdvertError(f"TXT record lacks {', '.join(missing)}; is this a prima daemon?")
    node_id = text[K_ID]
    if len(node_id.encode()) > MAX_NODE_ID_BYTES or not node_id.isprintable() or node_id != node_id.strip():
        raise AdvertError(f"node id {node_id[:40]!r} is not a printable name of <= {MAX_NODE_ID_BYTES} bytes")
    try:
        proto = int(text[K_PROTO])
    except ValueError:
        raise AdvertError(f"protocol version {text[K_PROTO][:20]!r} is not an integer") from None
    if not 0 < proto < 1 << 16:
        raise AdvertError(f"protocol version {proto} is out of range")
    fingerprint = text[K_FINGERPRINT]
    if not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise AdvertError(f"model fingerprint {fingerprint[:20]!r} is not 8-128 lowercase hex digits")
    model = text.get(K_MODEL, "")
    if len(model.encode()) > MAX_MODEL_NAME_BYTES or not model.isprintable():
        raise AdvertError(
            f"model name {model[:40]!r} is not a printable name of <= {MAX_MODEL_NAME_BYTES} bytes"
        )
    if not 0 < port < 1 << 16:
        raise AdvertError(f"port {port} is out of range")
    return NodeAdvert(node_id, host, port, fingerprint, model, proto, instance, text.get(K_FULL) == "1")


def pick_host(addresses: Iterable[str]) -> str | None:
    """The address to dial among those a service lists: a LAN IPv4 first, then loopback, then
    IPv6 (link-local last: it needs a scope that gRPC targets handle poorly)."""
    ranked = rank_hosts(addresses)
    return ranked[0] if ranked else None


def rank_hosts(addresses: Iterable[str]) -> list[str]:
    """The usable addresses among those a service lists, in the order to try them (pick_host's)."""

    def rank(text: str) -> int:
        try:
            ip = ipaddress.ip_address(text.split("%")[0])
        except ValueError:
            return 9
        if ip.version == 4:
            return 2 if ip.is_link_local else 1 if ip.is_loopback else 0
        return 5 if ip.is_link_local else 4 if ip.is_loopback else 3

    return [a for r, a in sorted((rank(a), a) for a in set(addresses)) if r < 9]


ProblemKind = Literal["duplicate_id", "protocol", "model"]


@dataclass(frozen=True)
class Problem:
    """Something that stops these nodes forming one ring, worded as what to do about it."""

    kind: ProblemKind
    message: str
    node_ids: tuple[str, ...]


def check_adverts(
    adverts: Sequence[NodeAdvert],
    *,
    protocol_version: int = PROTOCOL_VERSION,
    model_fingerprint: str | None = None,
) -> list[Problem]:
    """Duplicate node ids, protocol versions other than ours, and disagreeing model files.

    With `model_fingerprint` every node is compared to it; without, the nodes are compared with
    each other (any second fingerprint is a problem)."""
    problems: list[Problem] = []
    by_id: dict[str, list[NodeAdvert]] = {}
    for a in adverts:
        by_id.setdefault(a.node_id, []).append(a)
    for node_id, same in sorted(by_id.items()):
        if len({a.address for a in same}) > 1:
            where = ", ".join(sorted(a.address for a in same))
            problems.append(
                Problem(
                    "duplicate_id",
                    f"node id {node_id!r} is advertised by {len(same)} daemons ({where}); "
                    "give each primad its own --name",
                    (node_id,),
                )
            )
    for a in adverts:
        if a.protocol_version != protocol_version:
            problems.append(
                Problem(
                    "protocol",
                    f"node {a.node_id} at {a.address} speaks protocol v{a.protocol_version}, this prima "
                    f"v{protocol_version}; run the same prima version on every device",
                    (a.node_id,),
                )
            )
    if model_fingerprint is not None:
        for a in adverts:
            if a.model_fingerprint != model_fingerprint:
                problems.append(
                    Problem(
                        "model",
                        f"node {a.node_id} at {a.address} serves a different model file "
                        f"({_describe_model(a)}) than this coordinator ({model_fingerprint[:SHORT_FINGERPRINT]}); "
                        "start it with the same --model",
                        (a.node_id,),
                    )
                )
        return problems
    groups: dict[str, list[NodeAdvert]] = {}
    for a in adverts:
        groups.setdefault(a.model_fingerprint, []).append(a)
    if len(groups) > 1:
        # Largest group first: the odd ones out are most likely the ones to restart.
        ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0].model_fingerprint))
        which = "; ".join(
            f"{_describe_model(g[0])} on {', '.join(sorted(a.node_id for a in g))}" for g in ordered
        )
        problems.append(
            Problem(
                "model",
                f"the nodes serve {len(groups)} different model files: {which}; "
                "start every primad with the same --model",
                tuple(sorted({a.node_id for a in adverts})),
            )
        )
    return problems


def _describe_model(a: NodeAdvert) -> str:
    return f"{a.model_name} {a.short_fingerprint}" if a.model_name else a.short_fingerprint


def hint_addresses(
    adverts: Sequence[NodeAdvert],
    *,
    protocol_version: int = PROTOCOL_VERSION,
    model_fingerprint: str | None = None,
) -> list[str]:
    """The addresses worth a handshake, one each: adverts are hints, since anyone on the LAN can
    send one, and a node's identity comes from its certificate. Adverts for another protocol or
    (given `model_fingerprint`) another model are left out, and every problem is logged once, so
    a clashing or garbage advert cannot stop the genuine nodes from being found."""
    for problem in check_adverts(
        adverts, protocol_version=protocol_version, model_fingerprint=model_fingerprint
    ):
        warn_once(
            f"problem:{problem.message}",
            "mDNS (adverts are hints, checked at the handshake): %s",
            problem.message,
        )
    usable = [
        a
        for a in adverts
        if a.protocol_version == protocol_version
        and (model_fingerprint is None or a.model_fingerprint == model_fingerprint)
    ]
    return sorted({a.address for a in usable})


def require_consistent(
    adverts: Sequence[NodeAdvert],
    *,
    protocol_version: int = PROTOCOL_VERSION,
    model_fingerprint: str | None = None,
) -> list[NodeAdvert]:
    """`adverts` unchanged if they can form one ring, else PlanError listing every problem."""
    problems = check_adverts(adverts, protocol_version=protocol_version, model_fingerprint=model_fingerprint)
    if problems:
        raise PlanError("; and ".join(p.message for p in problems))
    return list(adverts)


# -- peer noise, said once -----------------------------------------------------------------------
_warned: set[str] = set()
_WARNED_MAX = 1024


def debug_once(key: str, msg: str, *args: object) -> None:
    """Noise worth one debug line per peer (a flood's each instance)."""
    if key not in _warned:
        _warn_key(key)
        log.debug(msg, *args)


def _warn_key(key: str) -> None:
    if len(_warned) >= _WARNED_MAX:
        _warned.clear()
    _warned.add(key)


def warn_once(key: str, msg: str, *args: object) -> None:
    """Peers repeat themselves every browse: warn the first time, then only at debug level."""
    if key in _warned:
        log.debug(msg, *args)
        return
    _warn_key(key)
    log.warning(msg, *args)
