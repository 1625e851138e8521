"""Secure by default: a coordinator without a cluster identity picks loopback daemons only,
whatever the addresses look like, and says how to form a cluster for the others."""

from __future__ import annotations

import pytest

from prima.coordinator.loopback_only import FORM_A_CLUSTER, is_loopback, split_loopback, usable_addresses
from prima.errors import UntrustedNodeError
from prima.net.credentials import ClusterCA

RESOLVED = {"pi.lan": ["192.168.1.20"], "me.lan": ["127.0.1.1"], "both.lan": ["127.0.0.1", "10.0.0.5"]}


def _resolve(host: str) -> list[str]:
    return RESOLVED.get(host, [])


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:7000", True),
        ("127.8.9.10:7000", True),
        ("[::1]:7000", True),
        ("localhost:7000", True),
        ("node.localhost:7000", True),
        ("me.lan:7000", True),  # Debian's own name resolves to 127.0.1.1
        ("192.168.1.20:7000", False),
        ("10.0.0.5:7000", False),
        ("[fe80::1%eth0]:7000", False),
        ("[2001:db8::1]:7000", False),
        ("pi.lan:7000", False),
        ("both.lan:7000", False),  # one of its addresses is elsewhere
        ("nowhere.lan:7000", False),  # does not resolve: nothing proves it is here
        ("0.0.0.0:7000", False),
    ],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address, _resolve) is loopback


def test_split_keeps_the_order_given() -> None:
    addresses = ["192.168.1.20:7000", "127.0.0.1:7001", "pi.lan:7002", "localhost:7003"]
    assert split_loopback(addresses, _resolve) == (
        ["127.0.0.1:7001", "localhost:7003"],
        ["192.168.1.20:7000", "pi.lan:7002"],
    )


def test_named_daemons_elsewhere_are_refused_saying_how_to_form_a_cluster() -> None:
    with pytest.raises(UntrustedNodeError) as caught:
        usable_addresses(["127.0.0.1:7000", "192.168.1.20:7000"], skip=False, identity=None, resolve=_resolve)
    message = str(caught.value)
    assert "192.168.1.20:7000" in message
    assert "127.0.0.1:7000" not in message
    assert FORM_A_CLUSTER in message
    for step in (
        "prima cluster init",
        "prima cluster invite",
        "prima cluster join --invite",
        "primad --join",
    ):
        assert step in message


def test_advertised_daemons_elsewhere_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    kept = usable_addresses(["10.9.8.7:7000", "127.0.0.1:7000"], skip=True, identity=None, resolve=_resolve)
    assert kept == ["127.0.0.1:7000"]
    assert "10.9.8.7:7000" in caplog.text
    assert "prima cluster init" in caplog.text


def test_a_member_uses_any_address() -> None:
    """With an identity, mutual TLS checks every daemon: nothing is left out here."""
    laptop = ClusterCA.create("home").issue("laptop")
    addresses = ["192.168.1.20:7000", "127.0.0.1:7001"]
    assert usable_addresses(addresses, skip=False, identity=laptop, resolve=_resolve) == addresses
