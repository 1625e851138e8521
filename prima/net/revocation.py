"""Removing a device from a cluster without a new CA: the CA device records the serial of every
certificate it issues, `prima cluster revoke NAME` puts that name's serials on a certificate
revocation list signed by the CA (revoked.crl), and daemons and coordinators holding that file
refuse those certificates. The list is one file: copy it to every device (`revoked.crl` in the
cluster directory); a running daemon picks up a new copy within RELOAD_S.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization

from prima.errors import InputError, UntrustedNodeError
from prima.net import credentials
from prima.net.credentials import ClusterCA, Identity, cert_name
from prima.net.peer_certificate import served_certificate

log = logging.getLogger("prima.net")

ISSUED_FILE = "issued.txt"  # on the CA device: "serial name role" per certificate it issued
REVOKED_FILE = "revoked.crl"
RELOAD_S = 2.0
CRL_DAYS = 3650


def record_issued(directory: Path, identity: Identity) -> None:
    """Note `identity`'s serial in the CA directory, so `revoke` can find it by name later."""
    serial = x509.load_pem_x509_certificate(identity.cert_pem).serial_number
    with (directory / ISSUED_FILE).open("a", encoding="utf-8") as f:
        f.write(f"{serial:x} {identity.name} {identity.role}\n")


def issued_serials(directory: Path, name: str) -> list[int]:
    """The serials of the certificates issued to `name` from this CA directory."""
    path = directory / ISSUED_FILE
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        serial, _, rest = line.partition(" ")
        if rest.rsplit(" ", 1)[0] == name:
            found.append(int(serial, 16))
    return found


def revoke(ca: ClusterCA, directory: Path, serials: list[int]) -> x509.CertificateRevocationList:
    """Add `serials` to the CA directory's revocation list (made if absent), signed anew."""
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    path = directory / REVOKED_FILE
    now = datetime.datetime.now(datetime.timezone.utc)
    entries: dict[int, datetime.datetime] = {}
    if path.is_file():
        old = x509.load_pem_x509_crl(path.read_bytes())
        entries = {e.serial_number: e.revocation_date_utc for e in old}
    for serial in serials:
        entries.setdefault(serial, now)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + datetime.timedelta(days=CRL_DAYS))
    )
    for serial, when in sorted(entries.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    return crl


def load_crl(data: bytes, roots_pem: bytes, source: str) -> frozenset[int]:
    """The revoked serials of a PEM CRL signed by one of the CAs in `roots_pem`; InputError if it
    is not one (a list nobody trusted signed could hide nothing, but it is surely a mistake)."""
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError as exc:
        raise InputError(
            f"{source} is not a revocation list ({exc}); copy it again from the CA device"
        ) from None
    for root in x509.load_pem_x509_certificates(roots_pem):
        try:
            if crl.issuer == root.subject and crl.is_signature_valid(root.public_key()):  # type: ignore[arg-type]
                return frozenset(e.serial_number for e in crl)
        except (InvalidSignature, TypeError):
            continue
    raise InputError(f"{source} is not signed by this device's cluster CA; copy it from the CA device")


class RevocationList:
    """The revoked serials in `path` (none while it is absent), re-read when the file changes,
    looked at no more often than every RELOAD_S."""

    def __init__(self, path: Path, roots_pem: bytes, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.roots_pem = roots_pem
        self._clock = clock
        self._lock = threading.Lock()
        self._serials: frozenset[int] = frozenset()
        self._stamp: tuple[int, int] | None = None
        self._checked = -RELOAD_S
        self.reload()

    def reload(self) -> None:
        """Read the file again if it changed; a broken copy keeps the previous list (and says so)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._serials, self._stamp = frozenset(), None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._serials = load_crl(self.path.read_bytes(), self.roots_pem, str(self.path))
        except (InputError, OSError) as exc:
            log.warning("keeping the previous revocation list: %s", exc)
            return
        log.info("revocation list %s: %d certificate(s) revoked", self.path, len(self._serials))

    def revoked(self, cert: x509.Certificate) -> bool:
        with self._lock:
            now = self._clock()
            if now - self._checked >= RELOAD_S:
                self._checked = now
                self.reload()
            return cert.serial_number in self._serials


def describe(cert: x509.Certificate) -> str:
    """A certificate for log lines and error messages: its name and serial."""
    return f"{cert_name(cert)[:64]!r} (serial {cert.serial_number:x})"


def this_devices_list() -> RevocationList | None:
    """The revocation list a coordinator on this device holds to its nodes: revoked.crl in its
    cluster directory, checked against the CAs it trusts; None when it has none."""
    identity = credentials.client_identity()
    path = credentials.cluster_dir() / REVOKED_FILE
    if identity is None or not path.is_file():
        return None
    return RevocationList(path, identity.roots_pem)


def check_node(revoked: RevocationList, address: str, node_id: str, timeout_s: float) -> None:
    """UntrustedNodeError if the daemon at `address` serves a revoked certificate (NodeError if
    it no longer answers)."""
    cert = served_certificate(
        address, revoked.roots_pem, timeout_s, node_id, client=credentials.client_identity()
    )
    if revoked.revoked(cert):
        raise UntrustedNodeError(
            f"node {node_id} at {address} holds the revoked certificate {describe(cert)}; it was removed "
            "from the cluster (prima cluster revoke): issue it a new identity to use it again"
        )
