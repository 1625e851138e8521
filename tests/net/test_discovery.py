"""Discovery: the TXT codec and consistency checks as pure functions, then real zeroconf on
127.0.0.1 (each network test on its own service type, so concurrent rings cannot interfere)."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from zeroconf import ServiceInfo, Zeroconf

from prima.cli.main import main
from prima.errors import InputError, PlanError
from prima.net import credentials, discovery
from prima.net.codec import PROTOCOL_VERSION
from prima.net.discovery import Advertiser
from prima.net.node_adverts import (
    MAX_MODEL_NAME_BYTES,
    AdvertError,
    NodeAdvert,
    check_adverts,
    decode_txt,
    encode_txt,
    hint_addresses,
    pick_host,
    require_consistent,
    warn_once,
)

from .hostile_adverts import hostile_adverts

LOOPBACK = ["127.0.0.1"]
FP_A = "a1" * 32
FP_B = "b2" * 32


def _advert(node_id: str, port: int, fp: str = FP_A, proto: int = PROTOCOL_VERSION) -> NodeAdvert:
    return NodeAdvert(node_id, "127.0.0.1", port, fp, "smollm2-135m", proto)


def _txt(**overrides: bytes | None) -> dict[bytes, bytes | None]:
    props: dict[bytes, bytes | None] = {b"id": b"n0", b"proto": b"1", b"fingerprint": FP_A.encode()}
    for k, v in overrides.items():
        if v is None:
            props.pop(k.encode(), None)
        else:
            props[k.encode()] = v
    return props


@pytest.fixture
def service_type() -> str:
    return f"_pt{secrets.token_hex(3)}._tcp.local."


@contextmanager
def advertising(adverts: Sequence[NodeAdvert], service_type: str) -> Iterator[list[Advertiser]]:
    """Register all at once: each registration probes the network for a second or two."""
    ads = [Advertiser(a, interfaces=LOOPBACK, service_type=service_type) for a in adverts]
    with ThreadPoolExecutor(len(ads)) as pool:
        try:
            list(pool.map(Advertiser.start, ads))
            yield ads
        finally:
            list(pool.map(Advertiser.close, ads))


# -- TXT codec -----------------------------------------------------------------------------------
def test_txt_roundtrip_keeps_every_field() -> None:
    a = _advert("node-1", 7601)
    props = {k.encode(): v.encode() for k, v in encode_txt(a).items()}
    assert decode_txt(props, a.host, a.port) == a


@pytest.mark.parametrize("full", [True, False])
def test_txt_carries_whether_a_daemon_holds_the_whole_file(full: bool) -> None:
    a = NodeAdvert("n0", "127.0.0.1", 7600, FP_A, "m", holds_full_file=full)
    props = {k.encode(): v.encode() for k, v in encode_txt(a).items()}
    assert decode_txt(props, a.host, a.port).holds_full_file is full
    assert not decode_txt(_txt(), "127.0.0.1", 7600).holds_full_file  # an older daemon


def test_txt_encode_clips_a_long_model_name() -> None:
    a = NodeAdvert("n0", "127.0.0.1", 7600, FP_A, "é" * 100 + "\n")
    name = encode_txt(a)["model"]
    assert name == "é" * 60
    assert len(name.encode()) == MAX_MODEL_NAME_BYTES


def test_txt_decode_ignores_unknown_keys_and_key_case() -> None:
    props = {b"ID": b"n0", b"Proto": b"1", b"fingerprint": FP_A.encode(), b"future": b"x", b"flag": None}
    got = decode_txt(props, "10.0.0.2", 7600)
    assert (got.node_id, got.protocol_version, got.model_name, got.address) == ("n0", 1, "", "10.0.0.2:7600")


@pytest.mark.parametrize(
    ("props", "why"),
    [
        (_txt(id=None), "lacks id"),
        (_txt(proto=None, fingerprint=None), "lacks proto, fingerprint"),
        (_txt(id=b""), "lacks id"),
        (_txt(id=b"\xff\xfe\x00garbage"), "not valid text"),
        ({b"\xc3\x28": b"1", **_txt()}, "not valid text"),
        (_txt(id=b"n\x00id"), "printable"),
        (_txt(id=b"x" * 64), "<= 63 bytes"),
        (_txt(proto=b"one"), "not an integer"),
        (_txt(proto=b"0"), "out of range"),
        (_txt(fingerprint=b"XYZ"), "lowercase hex"),
        (_txt(model=b"m" * 200), "model name"),
        ({**_txt(), **{f"k{i}".encode(): b"v" * 200 for i in range(6)}}, "1024-byte limit"),
    ],
)
def test_txt_decode_rejects_malformed_records(props: dict[bytes, bytes | None], why: str) -> None:
    with pytest.raises(AdvertError, match=why):
        decode_txt(props, "127.0.0.1", 7600)


def test_advertiser_rejects_an_id_no_browser_would_accept() -> None:
    with pytest.raises(InputError, match="another --name"):
        Advertiser(_advert("x" * 80, 7600), interfaces=LOOPBACK).start()


def test_pick_host_prefers_lan_ipv4_then_loopback_then_ipv6() -> None:
    assert pick_host(["fe80::1%2", "127.0.0.1", "192.168.1.5", "2001:db8::1"]) == "192.168.1.5"
    assert pick_host(["fe80::1%2", "2001:db8::1", "127.0.0.1"]) == "127.0.0.1"
    assert pick_host(["fe80::1%2", "2001:db8::1"]) == "2001:db8::1"
    assert pick_host(["not-an-ip"]) is None
    assert NodeAdvert("n", "2001:db8::1", 7600, FP_A).address == "[2001:db8::1]:7600"


def test_interfaces_come_from_argument_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(discovery.INTERFACES_ENV, "127.0.0.1, 10.0.0.2")
    assert discovery.resolve_interfaces(None) == ["127.0.0.1", "10.0.0.2"]
    assert discovery.resolve_interfaces(["192.168.1.5"]) == ["192.168.1.5"]
    monkeypatch.setenv(discovery.INTERFACES_ENV, "all")
    assert discovery.resolve_interfaces(None) == discovery.InterfaceChoice.All
    with pytest.raises(InputError, match="not an IP address"):
        discovery.resolve_interfaces(["eth0"])


# -- consistency checks --------------------------------------------------------------------------
def test_check_adverts_accepts_a_consistent_ring() -> None:
    ring = [_advert(f"node{i}", 7600 + i) for i in range(3)]
    assert check_adverts(ring) == []
    assert check_adverts(ring, model_fingerprint=FP_A) == []
    assert require_consistent(ring) == ring


def test_check_adverts_reports_duplicate_node_ids() -> None:
    problems = check_adverts([_advert("node0", 7600), _advert("node0", 7601), _advert("node1", 7602)])
    assert [(p.kind, p.node_ids) for p in problems] == [("duplicate_id", ("node0",))]
    assert problems[0].message == (
        "node id 'node0' is advertised by 2 daemons (127.0.0.1:7600, 127.0.0.1:7601); "
        "give each primad its own --name"
    )


def test_check_adverts_reports_protocol_mismatch() -> None:
    problems = check_adverts([_advert("node0", 7600), _advert("old", 7601, proto=PROTOCOL_VERSION + 1)])
    assert [(p.kind, p.node_ids) for p in problems] == [("protocol", ("old",))]
    assert f"speaks protocol v{PROTOCOL_VERSION + 1}, this prima v{PROTOCOL_VERSION}" in problems[0].message
    assert "same prima version" in problems[0].message


def test_check_adverts_reports_different_model_files() -> None:
    ring = [_advert("node0", 7600), _advert("node1", 7601), _advert("odd", 7602, fp=FP_B)]
    (problem,) = check_adverts(ring)
    assert problem.kind == "model"
    assert problem.message == (
        f"the nodes serve 2 different model files: smollm2-135m {FP_A[:12]} on node0, node1; "
        f"smollm2-135m {FP_B[:12]} on odd; start every primad with the same --model"
    )
    against = check_adverts(ring, model_fingerprint=FP_A)
    assert [(p.kind, p.node_ids) for p in against] == [("model", ("odd",))]
    assert "than this coordinator" in against[0].message


def test_require_consistent_raises_every_problem_at_once() -> None:
    ring = [_advert("n", 7600), _advert("n", 7601, fp=FP_B, proto=PROTOCOL_VERSION + 1)]
    with pytest.raises(PlanError, match="--name.*same prima version.*same --model"):
        require_consistent(ring)


def test_hint_addresses_keep_clashing_ids_and_drop_other_models(caplog: pytest.LogCaptureFixture) -> None:
    genuine = [_advert("node0", 7600), _advert("node1", 7601)]
    rogues = [
        _advert("node0", 7666),
        _advert("odd", 7667, fp=FP_B),
        _advert("old", 7668, proto=PROTOCOL_VERSION + 1),
    ]
    with caplog.at_level(logging.WARNING, "prima.net"):
        hints = hint_addresses([*genuine, *rogues], model_fingerprint=FP_A)
    # The clash is for the handshake to settle; other models and protocols cannot join anyway.
    assert hints == ["127.0.0.1:7600", "127.0.0.1:7601", "127.0.0.1:7666"]
    assert any("node0" in r.getMessage() for r in caplog.records)


def test_browse_with_expect_waits_past_a_clashing_advert(service_type: str) -> None:
    adverts = [_advert("node0", 17640), _advert("node0", 17641), _advert("node1", 17642)]
    with advertising(adverts, service_type):
        found = discovery.browse(5.0, interfaces=LOOPBACK, expect=2, service_type=service_type)
    assert {a.node_id for a in found} == {"node0", "node1"}


def test_warn_once_then_debug(caplog: pytest.LogCaptureFixture) -> None:
    key = f"test:{secrets.token_hex(4)}"
    with caplog.at_level(logging.DEBUG, logger="prima.net"):
        for _ in range(3):
            warn_once(key, "peer %s is noisy", "x")
    assert [r.levelno for r in caplog.records if r.getMessage() == "peer x is noisy"] == [
        logging.WARNING,
        logging.DEBUG,
        logging.DEBUG,
    ]


# -- zeroconf on loopback ------------------------------------------------------------------------
def test_browse_finds_every_advertised_node(service_type: str) -> None:
    adverts = [_advert(f"node{i}", 17600 + i) for i in range(2)]
    adverts.append(NodeAdvert("node2", "127.0.0.1", 17602, FP_A, "smollm2-135m", holds_full_file=True))
    with advertising(adverts, service_type):
        found = discovery.browse(3.0, interfaces=LOOPBACK, expect=3, service_type=service_type)
    fields = ("node_id", "address", "protocol_version", "model_fingerprint", "model_name", "holds_full_file")
    assert [tuple(getattr(a, f) for f in fields) for a in found] == [
        tuple(getattr(a, f) for f in fields) for a in adverts
    ]
    assert all(a.instance.endswith(service_type) for a in found)


def test_browse_forgets_a_closed_advertiser(service_type: str) -> None:
    with advertising([_advert("stays", 17610), _advert("leaves", 17611)], service_type) as ads:
        first = discovery.browse(3.0, interfaces=LOOPBACK, expect=2, service_type=service_type)
        ads[1].close()
        # Browse until the node that stays is in and 1.5 s have passed, so that the one that
        # left had time to answer if it wrongly still did (a fixed 1.5 s saw neither on a loaded
        # CI machine).
        started = time.monotonic()
        second = discovery.browse(
            10.0,
            interfaces=LOOPBACK,
            service_type=service_type,
            enough=lambda found: "stays" in {a.node_id for a in found} and time.monotonic() - started >= 1.5,
        )
    assert [a.node_id for a in first] == ["leaves", "stays"]
    assert [a.node_id for a in second] == ["stays"]


def _seen(watch: discovery.AdvertWatch, want: set[str], timeout_s: float = 10.0) -> set[str]:
    """The node ids `watch` holds once they are `want` (or when `timeout_s` has passed)."""
    deadline = time.monotonic() + timeout_s
    while (ids := {a.node_id for a in watch.adverts()}) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return ids


def test_watch_sees_daemons_come_and_go_while_it_is_open(service_type: str) -> None:
    watch = discovery.AdvertWatch(interfaces=LOOPBACK, service_type=service_type)
    try:
        assert watch.adverts() == []
        with advertising([_advert("early", 17620)], service_type):
            assert _seen(watch, {"early"}) == {"early"}
            # One that starts while the watch is open announces itself and is seen too.
            with advertising([_advert("late", 17621)], service_type):
                assert _seen(watch, {"early", "late"}) == {"early", "late"}
            assert _seen(watch, {"early"}) == {"early"}  # its goodbye removes it
    finally:
        watch.close()
    watch.close()  # twice is fine


def test_browse_sees_both_daemons_sharing_an_id(service_type: str) -> None:
    with advertising([_advert("twin", 17620), _advert("twin", 17621)], service_type):
        found = discovery.browse(3.0, interfaces=LOOPBACK, expect=2, service_type=service_type)
    assert [p.kind for p in check_adverts(found)] == ["duplicate_id"]


def test_browse_skips_malformed_txt_with_a_warning(
    service_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    bad = {
        "nokeys": {b"hello": b"world"},
        "garbage": {b"id": b"\xff\xfe\xfd", b"proto": b"1", b"fingerprint": FP_A.encode()},
        "badproto": {b"id": b"x", b"proto": b"\x00\x01", b"fingerprint": FP_A.encode()},
    }
    zc = Zeroconf(interfaces=LOOPBACK)
    infos = [
        ServiceInfo(
            service_type,
            f"{name}-{secrets.token_hex(3)}.{service_type}",
            port=17630 + i,
            properties=props,
            server=f"bad{i}.local.",
            parsed_addresses=LOOPBACK,
        )
        for i, (name, props) in enumerate(bad.items())
    ]
    try:
        with ThreadPoolExecutor(len(infos)) as pool:
            list(pool.map(lambda info: zc.register_service(info, cooperating_responders=True), infos))
        with (
            advertising([_advert("good", 17639)], service_type),
            caplog.at_level(logging.WARNING, "prima.net"),
        ):
            # Long enough for four responders to answer on a loaded 2-core CI machine (with 2 s
            # one full-suite run saw the good advert and none of the bad ones).
            found = discovery.browse(5.0, interfaces=LOOPBACK, service_type=service_type)
    finally:
        zc.close()
    assert [a.node_id for a in found] == ["good"]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == len(bad)
    for name in bad:
        assert any(name in m for m in skipped)


def test_nodes_command_lists_advertised_nodes_as_json(
    service_type: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(discovery, "SERVICE_TYPE", service_type)
    monkeypatch.setattr(credentials, "client_identity", lambda: None)  # nothing to check with
    adverts = [_advert(f"node{i}", 17640 + i) for i in range(2)]
    with advertising(adverts, service_type):
        code = main(["nodes", "--json", "--timeout", "3", "--expect", "2", "--interface", "127.0.0.1"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["protocol_version"] == PROTOCOL_VERSION
    assert doc["problems"] == []
    assert [(n["node_id"], n["address"], n["model_fingerprint"]) for n in doc["nodes"]] == [
        (a.node_id, a.address, FP_A) for a in adverts
    ]
    assert {n["membership"] for n in doc["nodes"]} == {"unverified"}


# -- prima nodes, without the network ------------------------------------------------------------
def test_nodes_command_prints_a_table_and_warnings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ring = [_advert("node0", 7600), _advert("node1", 7601, fp=FP_B)]
    monkeypatch.setattr(discovery, "browse", lambda *a, **k: ring)
    monkeypatch.setattr(credentials, "client_identity", lambda: None)
    assert main(["nodes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NODE", "ADDRESS", "MEMBERSHIP", "PROTO", "MODEL", "HASH", "MODEL"]
    assert lines[1].split() == [
        "node0",
        "127.0.0.1:7600",
        "unverified",
        f"v{PROTOCOL_VERSION}",
        FP_A[:12],
        "smollm2-135m",
    ]
    assert lines[3].startswith("warning: the nodes serve 2 different model files")


def test_nodes_command_fails_when_too_few_answer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(discovery, "browse", lambda *a, **k: [_advert("node0", 7600)])
    monkeypatch.setattr(credentials, "client_identity", lambda: None)
    assert main(["nodes", "--expect", "2", "--timeout", "0.1"]) == 1
    assert "found 1 of the 2 member(s) expected in 0.1 s" in capsys.readouterr().err


# -- garbage and hostile adverts -----------------------------------------------------------------
def test_garbage_adverts_never_hide_the_real_ones(
    service_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    """16 instances without an address record, 17 malformed TXT records and 40 adverts for dead
    ports (two claiming the real nodes' ids) beside two real adverts: every browse of five finds
    both real ones, and each skipped instance is warned about once across all five."""
    real = [_advert("node0", 17650), _advert("node1", 17651)]
    with (
        hostile_adverts(service_type, FP_A, clash_ids=("node0", "node1")),
        advertising(real, service_type),
        caplog.at_level(logging.DEBUG, "prima.net"),
    ):
        for _ in range(5):
            found = discovery.browse(5.0, interfaces=LOOPBACK, service_type=service_type, enough=_both_real)
            assert {a.address for a in found} >= {a.address for a in real}
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "skipping" in r.getMessage()
    ]
    assert len(warned) == len(set(warned))
    assert any("noaddr" in m for m in warned)
    assert any("bad" in m for m in warned)


def _both_real(found: list[NodeAdvert]) -> bool:
    return {"127.0.0.1:17650", "127.0.0.1:17651"} <= {a.address for a in found}


def test_a_flood_of_instances_is_capped(
    service_type: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(discovery, "MAX_INSTANCES", 8)
    with (
        hostile_adverts(service_type, FP_A, addressless=0, malformed=0, dead_ports=20),
        caplog.at_level(logging.DEBUG, "prima.net"),
    ):
        found = discovery.browse(2.0, interfaces=LOOPBACK, service_type=service_type)
    assert 0 < len(found) <= 8
    floods = [r.levelno for r in caplog.records if "a flood?" in r.getMessage()]
    assert floods.count(logging.WARNING) == 1  # then at debug level
    assert any("over the instance cap" in r.getMessage() for r in caplog.records)
