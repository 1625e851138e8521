"""`prima nodes`: browse mDNS for running daemons and list them, with anything that would stop
them forming one ring (a shared node id, another protocol version, different model files).

Exits 1 when fewer nodes answered than --expect (at least one), so scripts can wait on a ring."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from prima.net import discovery
from prima.net.codec import PROTOCOL_VERSION


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("nodes", help="list the primad daemons found on the LAN over mDNS")
    parser.add_argument(
        "--discover-timeout",
        "--timeout",
        dest="timeout",
        type=float,
        default=discovery.DEFAULT_BROWSE_S,
        help=f"seconds to listen for answers (default {discovery.DEFAULT_BROWSE_S:g})",
    )
    parser.add_argument(
        "--expect", type=int, default=None, help="stop listening as soon as this many nodes answered"
    )
    parser.add_argument(
        "--mdns-interface",
        "--interface",
        dest="interface",
        action="append",
        metavar="IP",
        help=f"this device's address to browse on; repeat for several (default: ${discovery.INTERFACES_ENV}, "
        "else all interfaces)",
    )
    parser.add_argument("--json", action="store_true", help="print the nodes and problems as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    adverts = discovery.browse(args.timeout, interfaces=args.interface, expect=args.expect)
    problems = discovery.check_adverts(adverts)
    if args.json:
        doc = {
            "protocol_version": PROTOCOL_VERSION,
            "nodes": [{**dataclasses.asdict(a), "address": a.address} for a in adverts],
            "problems": [dataclasses.asdict(p) for p in problems],
        }
        print(json.dumps(doc, indent=2))
    elif adverts:
        _print_table(adverts)
        for p in problems:
            print(f"warning: {p.message}")
    wanted = max(args.expect or 1, 1)
    if len(adverts) < wanted:
        found = f"found {len(adverts)} of the {wanted} node(s) expected" if args.expect else "found no node"
        print(
            f"prima: {found} in {args.timeout:g} s; check that primad "
            "runs without --no-mdns on this network, try --mdns-interface <this device's LAN IP>, or use "
            "--nodes host:port,... where multicast is blocked (Wi-Fi client isolation, containers)",
            file=sys.stderr,
        )
        return 1
    return 0


def _print_table(adverts: list[discovery.NodeAdvert]) -> None:
    rows = [
        (a.node_id, a.address, f"v{a.protocol_version}", a.short_fingerprint, a.model_name) for a in adverts
    ]
    header = ("NODE", "ADDRESS", "PROTO", "MODEL HASH", "MODEL")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
