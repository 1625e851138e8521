"""`prima cluster`: the credentials that make devices members of one cluster (docs/security.md).

prima cluster init                 on your main device: a new cluster CA, and this device's identity
prima cluster issue phone          a file holding the identity of node `phone`, signed by the CA
prima cluster join phone.pem       on the phone: install that file (or copy it to identity.pem)
prima cluster show                 this device's identity and cluster
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from prima.errors import InputError
from prima.net import credentials
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
    issue.set_defaults(func=cluster_issue)
    join = cs.add_parser("join", help="install an identity file made by `prima cluster issue`")
    join.add_argument("file", type=Path)
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
    credentials.write_private(where / credentials.IDENTITY_FILE, ca.issue(name).to_pem())
    print(f"cluster created in {where} (keep {credentials.CA_KEY_FILE} private: it admits devices)")
    print(f"this device is {name}; add another with: prima cluster issue NAME")
    return 0


def cluster_issue(args: argparse.Namespace) -> int:
    ca = ClusterCA.load(_dir(args))
    identity = ca.issue(args.name)
    out = args.out or Path(f"{args.name}.pem")
    credentials.write_private(out, identity.to_pem())
    print(f"wrote {out}; on the device run `prima cluster join {out.name}` (or copy it to")
    print(
        f"~/.config/prima/cluster/{credentials.IDENTITY_FILE}), then start primad there; delete {out} after"
    )
    return 0


def cluster_join(args: argparse.Namespace) -> int:
    identity = Identity.from_pem(args.file.read_bytes(), str(args.file))
    where = _dir(args)
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    credentials.write_private(where / credentials.IDENTITY_FILE, identity.to_pem())
    print(f"this device is now {identity.name} in its cluster ({where / credentials.IDENTITY_FILE})")
    return 0


def cluster_show(args: argparse.Namespace) -> int:
    where = _dir(args)
    identity = credentials.load_identity(where)
    if identity is None:
        print(f"no identity in {where}: run `prima cluster init` (first device) or `prima cluster join`")
        return 1
    keeper = (where / credentials.CA_KEY_FILE).exists()
    print(f"{identity.name} ({where}); {'holds' if keeper else 'does not hold'} the cluster CA key")
    return 0
