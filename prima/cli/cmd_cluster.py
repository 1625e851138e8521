"""`prima cluster`: the credentials that make devices members of one cluster (docs/security.md).

prima cluster init                 on your main device: a new cluster CA, and this device's identity
prima cluster issue phone          a file holding the identity of node `phone`, signed by the CA
prima cluster issue laptop --role coordinator   a device that runs prompts but serves no layers
prima cluster join phone.pem       on the phone: install that file (or copy it to identity.pem)
prima cluster invite phone         or, instead of a file: wait for the phone with a one-time code
prima cluster join --invite HOST:PORT/CODE    on the phone: join with that code (its key stays there)
prima cluster revoke phone         remove a device: its certificates go on revoked.crl (copy it
                                   to every device's cluster directory)
prima cluster show                 this device's identity and cluster
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from cryptography import x509

from prima.errors import InputError
from prima.net import credentials, discovery, invite, revocation
from prima.net.credentials import ClusterCA, Identity


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="create the cluster's credentials and add devices to it")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"cluster directory (default: ${credentials.CLUSTER_DIR_ENV}, else ~/.config/prima/cluster)",
    )
    cs = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    init = cs.add_parser("init", help="create a cluster CA and this device's identity")
    init.add_argument("--name", default=None, help="this device's node id (default: its hostname)")
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing cluster (rotates the secret: every device must be issued again)",
    )
    init.set_defaults(func=cluster_init)
    issue = cs.add_parser("issue", help="write the identity file of a device joining the cluster")
    issue.add_argument("name", help="the device's node id (primad serves under this name)")
    issue.add_argument("-o", "--out", type=Path, default=None, help="file to write (default: NAME.pem)")
    issue.add_argument(
        "--role",
        choices=credentials.ROLES,
        default=credentials.ROLE_NODE,
        help="node (default): serves in rings and may coordinate; coordinator: only calls daemons",
    )
    issue.set_defaults(func=cluster_issue)
    revoke = cs.add_parser("revoke", help="remove a device: refuse every certificate issued to NAME")
    revoke.add_argument("name", help="the device's node id, as issued")
    revoke.add_argument(
        "--serial",
        action="append",
        default=[],
        metavar="HEX",
        help="revoke this certificate serial (shown by `prima cluster show` on the device) instead",
    )
    revoke.set_defaults(func=cluster_revoke)
    inv = cs.add_parser("invite", help="let a device join with a one-time code (no file to copy)")
    inv.add_argument("name", help="the device's node id (primad serves under this name)")
    inv.add_argument("--role", choices=credentials.ROLES, default=credentials.ROLE_NODE, help="as for issue")
    inv.add_argument(
        "--listen",
        default=f"0.0.0.0:{invite.DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"where to wait for the device (default 0.0.0.0:{invite.DEFAULT_PORT})",
    )
    inv.add_argument(
        "--expires", type=float, default=invite.DEFAULT_EXPIRES_S, metavar="SECONDS", help="default 600"
    )
    inv.set_defaults(func=cluster_invite)
    join = cs.add_parser(
        "join", help="install an identity file made by `prima cluster issue`, or join with an invite"
    )
    join.add_argument("file", type=Path, nargs="?")
    join.add_argument("--invite", metavar="HOST:PORT/CODE", help="what `prima cluster invite` printed")
    join.set_defaults(func=cluster_join)
    show = cs.add_parser("show", help="print this device's identity")
    show.set_defaults(func=cluster_show)


def _dir(args: argparse.Namespace) -> Path:
    return args.dir or credentials.cluster_dir()


def cluster_init(args: argparse.Namespace) -> int:
    where = _dir(args)
    if (where / credentials.CA_KEY_FILE).exists() and not args.force:
        raise InputError(
            f"{where} already holds a cluster; --force replaces it (then issue every device again)"
        )
    name = args.name or socket.gethostname()[: credentials.MAX_NAME_CHARS]
    ca = ClusterCA.create(f"prima cluster of {name}")
    ca.save(where)
    (where / revocation.ISSUED_FILE).unlink(missing_ok=True)  # serials of the replaced CA
    (where / revocation.REVOKED_FILE).unlink(missing_ok=True)
    identity = ca.issue(name)
    revocation.record_issued(where, identity)
    credentials.write_private(where / credentials.IDENTITY_FILE, identity.to_pem())
    print(f"cluster created in {where} (keep {credentials.CA_KEY_FILE} private: it admits devices)")
    print(f"this device is {name}; add another with: prima cluster issue NAME")
    return 0


def cluster_issue(args: argparse.Namespace) -> int:
    ca = ClusterCA.load(_dir(args))
    identity = ca.issue(args.name, role=args.role)
    revocation.record_issued(_dir(args), identity)
    out = args.out or Path(f"{args.name}.pem")
    credentials.write_private(out, identity.to_pem())
    then = (
        "then `prima run`, `chat` and `serve` there reach the cluster's daemons"
        if identity.role == credentials.ROLE_COORDINATOR
        else "then start primad there"
    )
    print(f"wrote {out}; on the device run `prima cluster join {out.name}` (or copy it to")
    print(f"~/.config/prima/cluster/{credentials.IDENTITY_FILE}), {then}; delete {out} after")
    return 0


def cluster_revoke(args: argparse.Namespace) -> int:
    where = _dir(args)
    ca = ClusterCA.load(where)
    try:
        serials = [int(h, 16) for h in args.serial]
    except ValueError:
        raise InputError(f"--serial takes hexadecimal serials, got {args.serial}") from None
    serials = serials or revocation.issued_serials(where, args.name)
    if not serials:
        raise InputError(
            f"no certificate issued to {args.name!r} is recorded in {where / revocation.ISSUED_FILE}; "
            "check the name, or pass --serial HEX (shown by `prima cluster show` on that device)"
        )
    crl = revocation.revoke(ca, where, serials)
    print(f"revoked {len(serials)} certificate(s) of {args.name}; {len(list(crl))} revoked in all")
    print(
        f"copy {where / revocation.REVOKED_FILE} into every device's cluster directory: daemons refuse "
        "those certificates from then on, without a restart"
    )
    return 0


def cluster_invite(args: argparse.Namespace) -> int:
    where = _dir(args)
    ca = ClusterCA.load(where)
    credentials.check_name(args.name)
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--listen takes HOST:PORT, got {args.listen!r}")
    code = invite.new_code()
    try:
        server = socket.create_server((host.strip("[]"), int(port)))
    except OSError as exc:
        raise InputError(
            f"cannot listen on {args.listen} for the invite ({exc.strerror}); pick another --listen"
        ) from None
    with server:
        bound = server.getsockname()[1]
        hosts = discovery.advertised_addresses(host, discovery.resolve_interfaces("all"))
        print(f"waiting up to {args.expires:.0f} s for {args.name} to join; on it, run one of:")
        for h in hosts:
            print(f"  prima cluster join --invite {invite.Invite(h, bound, code)}")
        print(f"  (or start primad there with --join {invite.Invite(hosts[0], bound, code)})")
        cert = invite.serve_invite(
            ca,
            args.name,
            args.role,
            code,
            server,
            expires_s=args.expires,
            on_issued=lambda identity: revocation.record_issued(where, identity),
        )
    print(
        f"{credentials.cert_name(cert)} joined the cluster as a {args.role} (serial {cert.serial_number:x})"
    )
    return 0


def cluster_join(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.invite is None):
        raise InputError("give an identity file (from `prima cluster issue`) or --invite HOST:PORT/CODE")
    if args.invite is not None:
        identity = invite.join(invite.Invite.parse(args.invite))
    else:
        identity = Identity.from_pem(args.file.read_bytes(), str(args.file))
    install_identity(identity, _dir(args))
    return 0


def install_identity(identity: Identity, where: Path) -> None:
    """Write `identity` as this device's, saying so."""
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    credentials.write_private(where / credentials.IDENTITY_FILE, identity.to_pem())
    print(f"this device is now {identity.name} in its cluster ({where / credentials.IDENTITY_FILE})")


def cluster_show(args: argparse.Namespace) -> int:
    where = _dir(args)
    identity = credentials.load_identity(where)
    if identity is None:
        print(f"no identity in {where}: run `prima cluster init` (first device) or `prima cluster join`")
        return 1
    keeper = (where / credentials.CA_KEY_FILE).exists()
    serial = x509.load_pem_x509_certificate(identity.cert_pem).serial_number
    print(
        f"{identity.name}, a {identity.role} (serial {serial:x}) ({where}); "
        f"{'holds' if keeper else 'does not hold'} the cluster CA key"
    )
    return 0
