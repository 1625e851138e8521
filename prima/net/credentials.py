"""Cluster membership: a cluster CA, the certificates it issues, and the gRPC credentials made
from them. Every node and coordinator of a cluster holds an identity (its key, its certificate,
the cluster's CA certificate); traffic between them is mutual TLS, so a device without an
identity the cluster issued can neither join a ring nor call a daemon (see docs/security.md).

A certificate's common name is the node id it may serve under, and its organizational unit its
role: ROLE_NODE (a device that serves in rings and may also coordinate) or ROLE_COORDINATOR (a
device that only calls daemons, e.g. a laptop running `prima run`). A node's certificate carries
two DNS names: MEMBER_NAME, which every node shares (the TLS target name when the caller does
not yet know who is at an address), and `node_target_name(node_id)`, so a caller that expects a
given node checks at the handshake that the peer holds that node's certificate. A coordinator's
certificate carries neither, so it fails every caller's handshake if it is served as a node.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from prima.errors import InputError
from prima.paths import config_root

log = logging.getLogger("prima.net")

CLUSTER_DIR_ENV = "PRIMA_CLUSTER_DIR"
IDENTITY_FILE = "identity.pem"  # this device's key, certificate and the cluster's CA certificate
CA_KEY_FILE = "ca.key"  # only on the device that issues certificates (`prima cluster init`)
CA_CERT_FILE = "ca.crt"
MEMBER_NAME = "member.prima"
ROLE_NODE = "node"
ROLE_COORDINATOR = "coordinator"
ROLES = (ROLE_NODE, ROLE_COORDINATOR)
MAX_NAME_CHARS = 63  # node ids are at most 63 bytes (discovery's TXT limit); a CN at most 64
CA_DAYS = 3650
MEMBER_DAYS = 825


def node_target_name(node_id: str) -> str:
    """The DNS name in `node_id`'s certificate: a hash, since node ids need not be DNS labels."""
    return f"n-{hashlib.sha256(node_id.encode()).hexdigest()[:32]}.prima"


@dataclass(frozen=True)
class Identity:
    """A member's credentials: its private key and certificate (PEM), and the CA certificates it
    trusts (its cluster's; a process that also runs a local ring trusts that ring's too)."""

    name: str
    key_pem: bytes
    cert_pem: bytes
    roots_pem: bytes
    role: str = ROLE_NODE

    def to_pem(self) -> bytes:
        """One file a device can be given: key, certificate, then the CA certificates."""
        return self.key_pem + self.cert_pem + self.roots_pem

    @classmethod
    def from_pem(cls, data: bytes, source: str = "identity") -> Identity:
        """Parse `to_pem`'s file: InputError saying what is missing."""
        try:
            key = serialization.load_pem_private_key(data, password=None)
            certs = x509.load_pem_x509_certificates(data)
        except ValueError as exc:
            raise InputError(
                f"{source} is not a prima identity file ({exc}); make one with `prima cluster issue`"
            ) from None
        if len(certs) < 2:
            raise InputError(f"{source} lacks its certificate or the cluster's CA; issue it again")
        own, roots = certs[0], certs[1:]
        pem = serialization.Encoding.PEM
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return cls(
            name=cert_name(own),
            key_pem=key_pem,
            cert_pem=own.public_bytes(pem),
            roots_pem=b"".join(c.public_bytes(pem) for c in roots),
            role=cert_role(own),
        )

    def trusting(self, extra_roots_pem: bytes) -> Identity:
        """The same identity, also trusting the CA certificates in `extra_roots_pem`."""
        if not extra_roots_pem or extra_roots_pem in self.roots_pem:
            return self
        return dataclasses.replace(self, roots_pem=self.roots_pem + extra_roots_pem)


@dataclass(frozen=True)
class ClusterCA:
    """The cluster's certificate authority: whoever holds its key can add devices."""

    key_pem: bytes
    cert_pem: bytes

    @classmethod
    def create(cls, label: str = "prima cluster") -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label[:MAX_NAME_CHARS])])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        return cls(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, days: int = MEMBER_DAYS, role: str = ROLE_NODE) -> Identity:
        """A member identity for node id (or coordinator name) `name` in `role`, signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        return dataclasses.replace(self.certify(key.public_key(), name, days, role), key_pem=_key_pem(key))

    def certify(
        self, public_key: ec.EllipticCurvePublicKey, name: str, days: int = MEMBER_DAYS, role: str = ROLE_NODE
    ) -> Identity:
        """A member certificate for a key made elsewhere (an invite's joiner keeps its private
        key): the identity without its key (key_pem empty)."""
        check_name(name)
        if role not in ROLES:
            raise InputError(f"a member's role is one of {', '.join(ROLES)}, got {role[:40]!r}")
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        now = _now()
        node = role == ROLE_NODE
        sans: list[x509.GeneralName] = (
            [x509.DNSName(MEMBER_NAME), x509.DNSName(node_target_name(name))]
            if node
            else [x509.DNSName(f"{ROLE_COORDINATOR}.prima")]
        )
        usages = [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
        if node:
            usages.append(x509.oid.ExtendedKeyUsageOID.SERVER_AUTH)
        subject = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
        subject.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(subject))
            .issuer_name(ca_cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        return Identity(name, b"", cert_pem, self.cert_pem, role)

    def save(self, directory: Path) -> None:
        """Write ca.key (owner-only) and ca.crt into `directory`."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(directory / CA_KEY_FILE, self.key_pem)
        (directory / CA_CERT_FILE).write_bytes(self.cert_pem)

    @classmethod
    def load(cls, directory: Path) -> ClusterCA:
        key, cert = directory / CA_KEY_FILE, directory / CA_CERT_FILE
        if not key.is_file() or not cert.is_file():
            raise InputError(
                f"no cluster CA in {directory}; run `prima cluster init` there first (or issue "
                "certificates on the device that ran it)"
            )
        return cls(key.read_bytes(), cert.read_bytes())


def check_name(name: str) -> None:
    """InputError unless `name` can be a node id in a certificate."""
    if not name or len(name.encode()) > MAX_NAME_CHARS or not name.isprintable():
        raise InputError(f"a member name must be 1-{MAX_NAME_CHARS} printable bytes, got {name[:80]!r}")


def cert_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def cert_role(cert: x509.Certificate) -> str:
    """The role a certificate was issued for; certificates from before roles existed are nodes."""
    units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return str(units[0].value) if units else ROLE_NODE


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by its owner only (created so, never widened after the fact)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def cluster_dir() -> Path:
    """`$PRIMA_CLUSTER_DIR`, else `cluster/` in prima's config directory."""
    explicit = os.environ.get(CLUSTER_DIR_ENV)
    return Path(explicit).expanduser() if explicit else config_root() / "cluster"


def load_identity(directory: Path | None = None) -> Identity | None:
    """This device's identity from `directory` (default: cluster_dir()), None if it has none."""
    path = (directory or cluster_dir()) / IDENTITY_FILE
    if not path.is_file():
        return None
    return Identity.from_pem(path.read_bytes(), str(path))


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- gRPC ----------------------------------------------------------------------------------------
def server_credentials(identity: Identity) -> grpc.ServerCredentials:
    """TLS that requires every caller to present a certificate from a trusted CA."""
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem)],
        root_certificates=identity.roots_pem,
        require_client_auth=True,
    )


def channel_credentials(identity: Identity) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=identity.roots_pem,
        private_key=identity.key_pem,
        certificate_chain=identity.cert_pem,
    )


def target_name_option(node_id: str | None) -> tuple[str, str]:
    """The channel option that makes the handshake check who answers: `node_id` if the caller
    expects a particular node, else any member."""
    return ("grpc.ssl_target_name_override", node_target_name(node_id) if node_id else MEMBER_NAME)


def peer_name(context: grpc.ServicerContext) -> str | None:
    """The node id in the caller's verified certificate; None on a plaintext server."""
    auth = context.auth_context()
    names = auth.get("x509_common_name")
    return names[0].decode(errors="replace") if names else None


# -- this process's client identity ----------------------------------------------------------------
_lock = threading.Lock()
_local_ca: ClusterCA | None = None
_local_coordinator: Identity | None = None
_local_file_server: Identity | None = None


def local_ca() -> ClusterCA:
    """A throwaway CA for the local rings this process starts: its key lives in memory only, so
    the daemons it certifies accept this process and each other, nobody else."""
    global _local_ca, _local_coordinator
    with _lock:
        if _local_ca is None:
            _local_ca = ClusterCA.create("prima local ring")
            _local_coordinator = _local_ca.issue("coordinator", role=ROLE_COORDINATOR)
        return _local_ca


def client_identity() -> Identity | None:
    """What this process presents when it calls a daemon: the device's cluster identity (also
    trusting the local rings' CA, if one was made), else the local rings' coordinator identity,
    else None (plaintext: only daemons without credentials, on loopback, answer)."""
    own = load_identity()
    with _lock:
        local = _local_coordinator
    if own is None:
        return local
    return own.trusting(local.roots_pem) if local else own


def file_server_identity() -> Identity | None:
    """What this process serves its model file's bytes with (prima.coordinator.file_source): a
    server needs a certificate made for serving, which only the node role has. The device's own
    identity when it is a node's; else, for local rings, a node identity of their throwaway CA
    (made once, its key in memory); else None (a coordinator-only device does not serve)."""
    global _local_file_server
    own = load_identity()
    with _lock:
        local, ca = _local_coordinator, _local_ca
    if own is not None and own.role == ROLE_NODE:
        return own.trusting(local.roots_pem) if local else own
    if ca is None:
        return None
    with _lock:
        if _local_file_server is None:
            _local_file_server = ca.issue("coordinator-files", role=ROLE_NODE)
        served = _local_file_server
    return served.trusting(own.roots_pem) if own is not None else served


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
