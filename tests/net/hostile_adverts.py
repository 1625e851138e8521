"""Garbage and hostile mDNS adverts, registered with python-zeroconf directly on 127.0.0.1: the
LAN a coordinator must find its members on anyway. Each kind as a home network may see it:
instances that never send an address record, TXT records no prima daemon sends, and a crowd of
well-formed adverts (some claiming genuine nodes' ids) for ports where nothing listens."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

from zeroconf import ServiceInfo, Zeroconf

from prima.net.node_adverts import NodeAdvert, encode_txt

LOOPBACK = "127.0.0.1"

MALFORMED_TXT: list[dict[bytes, bytes]] = [
    {b"hello": b"world"},
    {b"id": b"\xff\xfe\xfd", b"proto": b"1"},
    {b"id": b"x", b"proto": b"\x00\x01", b"fingerprint": b"ab" * 16},
    {b"id": b"x", b"proto": b"one", b"fingerprint": b"ab" * 16},
    {b"id": b"x", b"proto": b"1", b"fingerprint": b"NOT-HEX"},
    {b"id": b"x" * 63, b"proto": b"99999999", b"fingerprint": b"ab" * 16},
    {b"id": b"n\x00", b"proto": b"1", b"fingerprint": b"ab" * 16},
    {**{f"k{i}".encode(): b"v" * 150 for i in range(8)}},
]


@contextmanager
def hostile_adverts(
    service_type: str,
    fingerprint: str,
    *,
    addressless: int = 16,
    malformed: int = 17,
    dead_ports: int = 40,
    clash_ids: tuple[str, ...] = (),
    extra: tuple[NodeAdvert, ...] = (),
) -> Iterator[None]:
    """Registered for the duration: `addressless` instances with a valid TXT record but no
    address record, `malformed` with broken TXT records, `dead_ports` valid adverts for ports
    where nothing listens (their node ids cycling through `clash_ids` first), and `extra`."""
    tag = secrets.token_hex(2)
    with ExitStack() as stack:
        # Ports held bound but never listening: a connection there is refused, whatever else runs.
        holes = [stack.enter_context(socket.socket()) for _ in range(dead_ports)]
        for s in holes:
            s.bind((LOOPBACK, 0))
        infos: list[ServiceInfo] = []
        for i in range(addressless):
            props = encode_txt(NodeAdvert(f"noaddr{i}", LOOPBACK, 7600, fingerprint))
            infos.append(
                _info(service_type, f"noaddr{i}-{tag}", 7600, props, server=f"noaddr{i}-{tag}", addresses=())
            )
        for i in range(malformed):
            infos.append(
                _info(service_type, f"bad{i}-{tag}", 7600 + i, MALFORMED_TXT[i % len(MALFORMED_TXT)])
            )
        ids = [*clash_ids, *(f"dead{i}" for i in range(dead_ports))]
        for i, s in enumerate(holes):
            port = s.getsockname()[1]
            props = encode_txt(NodeAdvert(ids[i], LOOPBACK, port, fingerprint, "m", holds_full_file=True))
            infos.append(_info(service_type, f"dead{i}-{tag}", port, props))
        for a in extra:
            infos.append(_info(service_type, f"{a.node_id}-{tag}", a.port, encode_txt(a)))
        zc = Zeroconf(interfaces=[LOOPBACK])
        stack.callback(zc.close)
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda info: zc.register_service(info, cooperating_responders=True), infos))
        yield


def _info(
    service_type: str,
    instance: str,
    port: int,
    props: dict[bytes, bytes] | dict[str, str],
    *,
    server: str | None = None,
    addresses: tuple[str, ...] = (LOOPBACK,),
) -> ServiceInfo:
    return ServiceInfo(
        service_type,
        f"{instance}.{service_type}",
        port=port,
        properties=props,
        server=f"{server or instance}.local.",
        parsed_addresses=list(addresses),
    )
