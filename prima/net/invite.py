"""Joining a cluster with a one-time code instead of copying an identity file.

On the device holding the cluster CA, `prima cluster invite phone` listens on the LAN and prints
an invite: where it listens and a code of 16 characters (80 random bits). On the phone,
`prima cluster join --invite HOST:PORT/CODE` (or `primad --join HOST:PORT/CODE`) makes its own
key pair and asks for a certificate; the private key never leaves the device.

Both sides prove they know the code with an HMAC over what they send, in one round trip:

    joiner -> inviter   {"nonce", "public_key", "proof": HMAC(code, "join", nonce, public_key)}
    inviter -> joiner   {"cert", "ca", "proof": HMAC(code, "issue", nonce, cert, ca)}

A stranger on the LAN who connects without the code gets nothing, and after MAX_BAD_PROOFS wrong
proofs the invite is spent (guessing has 3 tries at 2^80). A stranger who answers in the
inviter's place cannot make the second proof, so the joiner installs nothing. Someone who
records the exchange could try codes offline against the first proof: 80 bits puts that out of
reach, and the certificate it would buy is for a key they do not have. Invites end after one
join or `expires_s`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from prima.errors import InputError, PrimaError
from prima.net.credentials import ClusterCA, Identity, cert_name

log = logging.getLogger("prima.net")

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford's base32: no I, L, O, U
CODE_CHARS = 16  # 80 bits
DEFAULT_PORT = 7690
MAX_MESSAGE_BYTES = 16 << 10
MAX_BAD_PROOFS = 3
IO_TIMEOUT_S = 10.0
DEFAULT_EXPIRES_S = 600.0


class InviteError(PrimaError):
    """An invite could not be used: wrong code, expired or spent, or the other side is not who
    the code says."""


def new_code() -> str:
    """A fresh code, shown as four groups of four."""
    raw = "".join(secrets.choice(ALPHABET) for _ in range(CODE_CHARS))
    return "-".join(raw[i : i + 4] for i in range(0, CODE_CHARS, 4))


def normalize_code(text: str) -> str:
    """The code as compared: upper case, without dashes or spaces; O read as 0, I and L as 1."""
    code = (
        text.upper().replace("-", "").replace(" ", "").replace("O", "0").replace("I", "1").replace("L", "1")
    )
    if len(code) != CODE_CHARS or any(c not in ALPHABET for c in code):
        raise InputError(f"an invite code is {CODE_CHARS} characters of {ALPHABET} (dashes optional)")
    return code


@dataclass(frozen=True)
class Invite:
    """Where an inviter listens and its code: `HOST:PORT/CODE` as printed and typed."""

    host: str
    port: int
    code: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}/{self.code}"

    @classmethod
    def parse(cls, text: str) -> Invite:
        where, sep, code = text.strip().rpartition("/")
        host, _, port = where.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(
                f"an invite looks like HOST:PORT/CODE (as `prima cluster invite` prints), got {text!r}"
            )
        normalize_code(code)
        return cls(host.strip("[]"), int(port), code)


def _proof(code: str, *parts: str) -> str:
    msg = "\n".join(parts).encode()
    return hmac.new(normalize_code(code).encode(), msg, hashlib.sha256).hexdigest()


def join_request(code: str, public_key_pem: str) -> dict[str, str]:
    nonce = secrets.token_hex(16)
    return {
        "nonce": nonce,
        "public_key": public_key_pem,
        "proof": _proof(code, "join", nonce, public_key_pem),
    }


def check_join_request(code: str, msg: object) -> tuple[str, str]:
    """(nonce, public key PEM) of a joiner who knows `code`; InviteError otherwise."""
    if not isinstance(msg, dict) or not all(
        isinstance(msg.get(k), str) for k in ("nonce", "public_key", "proof")
    ):
        raise InviteError("not a join request")
    want = _proof(code, "join", msg["nonce"], msg["public_key"])
    if not hmac.compare_digest(want, msg["proof"]):
        raise InviteError("the joiner's proof does not match this invite's code")
    return msg["nonce"], msg["public_key"]


def issue_reply(code: str, nonce: str, cert_pem: str, ca_pem: str) -> dict[str, str]:
    return {"cert": cert_pem, "ca": ca_pem, "proof": _proof(code, "issue", nonce, cert_pem, ca_pem)}


def check_issue_reply(code: str, nonce: str, msg: object) -> tuple[str, str]:
    """(certificate PEM, CA PEM) from the inviter who made `code`; InviteError otherwise."""
    if not isinstance(msg, dict):
        raise InviteError("the inviter's answer is not a reply")
    if "error" in msg:
        raise InviteError(f"the inviter refused: {str(msg['error'])[:200]}")
    if not all(isinstance(msg.get(k), str) for k in ("cert", "ca", "proof")):
        raise InviteError("the inviter's answer is not a reply")
    want = _proof(code, "issue", nonce, msg["cert"], msg["ca"])
    if not hmac.compare_digest(want, msg["proof"]):
        raise InviteError(
            "whoever answered at that address does not know the invite's code: it is not your "
            "inviter (nothing was installed)"
        )
    return msg["cert"], msg["ca"]


# -- the wire: one JSON object per line ---------------------------------------------------------
def _send(sock: socket.socket, msg: dict[str, str]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def _receive(sock: socket.socket) -> object:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES:
            raise InviteError(f"a message over {MAX_MESSAGE_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError:
        raise InviteError("a message that is not JSON") from None


# -- the two sides ------------------------------------------------------------------------------
def join(invite: Invite, timeout_s: float = IO_TIMEOUT_S) -> Identity:
    """This device's identity from the inviter: a new key made here, the inviter's certificate
    for it. InviteError when the code is wrong, spent or expired, or the answer is forged."""
    key = ec.generate_private_key(ec.SECP256R1())
    public_pem = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    request = join_request(invite.code, public_pem)
    try:
        with socket.create_connection((invite.host, invite.port), timeout=timeout_s) as sock:
            _send(sock, request)
            reply = _receive(sock)
    except OSError as exc:
        raise InviteError(
            f"cannot reach the inviter at {invite.host}:{invite.port} ({exc}); is `prima cluster invite` still "
            "waiting there, and the port open?"
        ) from None
    cert_pem, ca_pem = check_issue_reply(invite.code, request["nonce"], reply)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    if cert.public_key() != key.public_key():
        raise InviteError("the certificate the inviter sent is for another key")
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Identity.from_pem(key_pem + cert_pem.encode() + ca_pem.encode(), f"the invite from {invite.host}")


def serve_invite(
    ca: ClusterCA,
    name: str,
    role: str,
    code: str,
    server: socket.socket,
    *,
    expires_s: float = DEFAULT_EXPIRES_S,
    on_issued: Callable[[Identity], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> x509.Certificate:
    """Answer joiners on the listening `server` until one proves it knows `code`; return the
    certificate issued to it (node id `name`, `role`). InviteError once MAX_BAD_PROOFS wrong
    proofs arrived, or after `expires_s`. `on_issued` sees the issued identity (no private key)."""
    deadline = clock() + expires_s
    bad = 0
    while True:
        left = deadline - clock()
        if left <= 0:
            raise InviteError(f"the invite for {name} expired unused after {expires_s:.0f} s; make a new one")
        server.settimeout(min(left, 1.0))
        try:
            sock, peer = server.accept()
        except TimeoutError:
            continue
        with sock:
            sock.settimeout(IO_TIMEOUT_S)
            try:
                nonce, public_pem = check_join_request(code, _receive(sock))
            except (InviteError, OSError) as exc:
                bad += 1
                log.warning(
                    "invite for %s: %s from %s (%d of %d tries)", name, exc, peer[0], bad, MAX_BAD_PROOFS
                )
                try:
                    _send(sock, {"error": "wrong invite code"})
                except OSError:
                    pass
                if bad >= MAX_BAD_PROOFS:
                    raise InviteError(
                        f"{bad} joiners without the right code tried the invite for {name}: it is spent; "
                        "make a new one"
                    ) from None
                continue
            try:
                public_key = serialization.load_pem_public_key(public_pem.encode())
                if not isinstance(public_key, ec.EllipticCurvePublicKey):
                    raise InviteError("the joiner's key is not an elliptic-curve key")
                identity = ca.certify(public_key, name, role=role)
                _send(sock, issue_reply(code, nonce, identity.cert_pem.decode(), ca.cert_pem.decode()))
            except (InviteError, ValueError) as exc:
                _send(sock, {"error": str(exc)[:200]})
                raise InviteError(
                    f"the joiner at {peer[0]} knew the code but sent a bad key: {exc}"
                ) from None
            if on_issued is not None:
                on_issued(identity)
            cert = x509.load_pem_x509_certificate(identity.cert_pem)
            log.info("invite for %s: issued to %s at %s", cert_name(cert), name, peer[0])
            return cert
