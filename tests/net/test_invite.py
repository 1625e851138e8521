"""Invites: a device joins with a one-time code over real sockets on 127.0.0.1 and gets a
certificate of the cluster for a key it made itself; a wrong code, a forged inviter, guessing
and expiry all end without an identity."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from prima.errors import InputError
from prima.net import credentials, invite, revocation
from prima.net.credentials import ClusterCA, Identity
from prima.net.invite import Invite, InviteError, join, new_code, normalize_code, serve_invite
from tests.primad_proc import start_primad


@pytest.fixture(scope="module")
def ca() -> ClusterCA:
    return ClusterCA.create("test cluster")


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


def _serve_in_background(
    ca: ClusterCA, code: str, server: socket.socket, **kwargs: object
) -> dict[str, object]:
    """serve_invite in a thread; the dict gets its "cert" or its "error" and the issued "identity"."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["cert"] = serve_invite(
                ca,
                "phone",
                credentials.ROLE_NODE,
                code,
                server,
                on_issued=lambda i: out.update(identity=i),
                **kwargs,
            )  # type: ignore[arg-type]
        except InviteError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    out["thread"] = thread
    return out


def test_codes_are_80_bits_in_groups_and_forgive_how_they_are_typed() -> None:
    code = new_code()
    assert [len(group) for group in code.split("-")] == [4, 4, 4, 4]
    assert normalize_code(code.lower().replace("-", " ")) == code.replace("-", "")
    assert normalize_code("0000-1111-OOOO-IiLl") == "0000111100001111"
    for bad in ("ABCD", "ABCD-EFGH-JKMN-PQRU", "!" * 16):
        with pytest.raises(InputError, match="16 characters"):
            normalize_code(bad)
    assert len({new_code() for _ in range(100)}) == 100


def test_invites_parse_as_printed() -> None:
    assert Invite.parse("192.168.1.5:7690/ABCD-EFGH-JKMN-PQRS") == Invite(
        "192.168.1.5", 7690, "ABCD-EFGH-JKMN-PQRS"
    )
    assert str(Invite("10.0.0.2", 7690, "ABCD-EFGH-JKMN-PQRS")) == "10.0.0.2:7690/ABCD-EFGH-JKMN-PQRS"
    for bad in ("192.168.1.5/ABCD-EFGH-JKMN-PQRS", "host:99999/ABCD-EFGH-JKMN-PQRS", "h:1/short"):
        with pytest.raises(InputError):
            Invite.parse(bad)


def test_a_device_joins_with_the_code_and_keeps_its_own_key(ca: ClusterCA, listening: socket.socket) -> None:
    code = new_code()
    served = _serve_in_background(ca, code, listening)
    identity = join(Invite("127.0.0.1", listening.getsockname()[1], code))
    served["thread"].join(10)  # type: ignore[attr-defined]
    assert identity.name == "phone"
    assert identity.role == credentials.ROLE_NODE
    cert = x509.load_pem_x509_certificate(identity.cert_pem)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    assert served["cert"] == cert
    issued = served["identity"]
    assert isinstance(issued, Identity)
    assert issued.key_pem == b""  # the inviter never had the key
    assert Identity.from_pem(identity.to_pem()) == identity  # a whole identity file, key included


def test_wrong_codes_get_nothing_and_spend_the_invite(ca: ClusterCA, listening: socket.socket) -> None:
    code = new_code()
    served = _serve_in_background(ca, code, listening)
    port = listening.getsockname()[1]
    for _ in range(invite.MAX_BAD_PROOFS):
        with pytest.raises(InviteError, match="refused: wrong invite code"):
            join(Invite("127.0.0.1", port, new_code()))
    served["thread"].join(10)  # type: ignore[attr-defined]
    assert "spent" in str(served["error"])
    assert "cert" not in served
    with pytest.raises(InviteError, match="cannot reach the inviter"):  # nobody waits any more
        join(Invite("127.0.0.1", port, code), timeout_s=2)


def test_an_answer_without_the_code_is_not_installed(ca: ClusterCA, listening: socket.socket) -> None:
    """Someone else answering at the inviter's address (it has a CA of its own, not the code)."""
    rogue = ClusterCA.create("rogue")

    def answer() -> None:
        sock, _ = listening.accept()
        with sock:
            request = invite._receive(sock)
            assert isinstance(request, dict)
            forged = rogue.issue("phone")
            invite._send(
                sock,
                invite.issue_reply(
                    new_code(), request["nonce"], forged.cert_pem.decode(), rogue.cert_pem.decode()
                ),
            )

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(InviteError, match="does not know the invite's code"):
        join(Invite("127.0.0.1", listening.getsockname()[1], new_code()))


def test_an_unused_invite_expires(ca: ClusterCA, listening: socket.socket) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.6
        return now[0]

    with pytest.raises(InviteError, match="expired unused"):
        serve_invite(ca, "phone", credentials.ROLE_NODE, new_code(), listening, expires_s=2.0, clock=clock)


@pytest.mark.slow
def test_invite_and_join_commands(tmp_path: Path) -> None:
    """The commands a user types: `prima cluster init` and `invite` on one device, `join
    --invite` on another (its own cluster directory), then `show` there."""
    main_dir, phone_dir = tmp_path / "main", tmp_path / "phone"
    prima = [sys.executable, "-m", "prima.cli.main", "cluster"]
    subprocess.run([*prima, "--dir", str(main_dir), "init", "--name", "laptop"], check=True, timeout=60)
    inviter = subprocess.Popen(
        [*prima, "--dir", str(main_dir), "invite", "phone", "--listen", "127.0.0.1:0", "--expires", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert inviter.stdout is not None
        printed = [inviter.stdout.readline() for _ in range(2)]
        line = next(p for p in printed if "--invite" in p)
        code = line.split("--invite", 1)[1].strip()
        joined = subprocess.run(
            [*prima, "--dir", str(phone_dir), "join", "--invite", code],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert joined.returncode == 0, joined.stderr
        out, err = inviter.communicate(timeout=30)
    finally:
        if inviter.poll() is None:
            inviter.kill()
    assert inviter.returncode == 0, err
    assert "phone joined the cluster as a node" in out
    shown = subprocess.run(
        [*prima, "--dir", str(phone_dir), "show"], capture_output=True, text=True, timeout=60, check=True
    )
    assert shown.stdout.startswith("phone, a node")
    assert revocation.issued_serials(main_dir, "phone")  # so `prima cluster revoke phone` finds it


@pytest.mark.slow
def test_primad_joins_with_an_invite_then_serves_under_its_name(
    ca: ClusterCA, listening: socket.socket, smollm2_path: Path, tmp_path: Path
) -> None:
    code = new_code()
    served = _serve_in_background(ca, code, listening)
    cluster_dir = tmp_path / "cluster"
    daemon = start_primad(
        "127.0.0.1",
        0,
        smollm2_path,
        tmp_path,
        "--join",
        str(Invite("127.0.0.1", listening.getsockname()[1], code)),
        "--cluster-dir",
        str(cluster_dir),
    )
    try:
        assert daemon.ready["node_id"] == "phone"
        assert daemon.ready["transport"] == "mutual TLS"
        installed = credentials.load_identity(cluster_dir)
        assert installed is not None
        assert installed.name == "phone"
        assert "cert" in served
    finally:
        daemon.stop()
