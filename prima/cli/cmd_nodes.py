"""`prima nodes`: browse mDNS for running daemons and list them, each marked as a member of this
device's cluster (it served a node certificate of it), not a member, or unverified, with anything
that would stop them forming one ring (a shared node id, another protocol version, different
model files).

Exits 1 when fewer members answered than --expect (at least one), so scripts can wait on a ring.
Without a cluster identity nothing can be checked: the daemons on this machine, the only ones
such a device uses, count instead."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

from prima.net import discovery
from prima.net.codec import PROTOCOL_VERSION
from prima.net.node_adverts import NodeAdvert, check_adverts

if TYPE_CHECKING:
    from prima.coordinator.members import Check, Found


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
        "--expect",
        type=int,
        default=None,
        help="stop listening as soon as this many members answered (adverts that prove nothing do not count)",
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
    from prima.coordinator.members import discover_members

    found = discover_members(args.timeout, interfaces=args.interface, expect=args.expect)
    adverts = list(found.adverts)
    problems = check_adverts(adverts)
    if args.json:
        doc = {
            "protocol_version": PROTOCOL_VERSION,
            "nodes": [_node_json(a, found.check(a)) for a in adverts],
            "problems": [dataclasses.asdict(p) for p in problems],
        }
        print(json.dumps(doc, indent=2))
    elif adverts:
        _print_table(adverts, found)
        for p in problems:
            print(f"warning: {p.message}")
    wanted = max(args.expect or 1, 1)
    members = len(found.node_ids)
    if members < wanted:
        what = f"{members} of the {wanted} member(s) expected" if args.expect else "no member"
        shown = f" ({len(adverts)} advert(s): see above)" if adverts and not args.json else ""
        print(
            f"prima: found {what} in {args.timeout:g} s{shown}; check that primad "
            "runs without --no-mdns on this network, try --mdns-interface <this device's LAN IP>, or use "
            "--nodes host:port,... where multicast is blocked (Wi-Fi client isolation, containers)",
            file=sys.stderr,
        )
        return 1
    return 0


def _node_json(advert: NodeAdvert, check: Check) -> dict[str, object]:
    return {
        **dataclasses.asdict(advert),
        "address": advert.address,
        "membership": check.verdict,
        "member_id": check.node_id,
        "membership_reason": check.reason,
    }


def _print_table(adverts: list[NodeAdvert], found: Found) -> None:
    rows = []
    for a in adverts:
        check = found.check(a)
        mark = check.verdict
        if check.node_id is not None and check.node_id != a.node_id:
            mark = f"member as {check.node_id}"
        rows.append((a.node_id, a.address, mark, f"v{a.protocol_version}", a.short_fingerprint, a.model_name))
    header = ("NODE", "ADDRESS", "MEMBERSHIP", "PROTO", "MODEL HASH", "MODEL")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
