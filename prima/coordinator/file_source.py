"""The coordinator as a source of the model's bytes for its ring (#17).

The `prima` process that plans a ring usually holds the whole model file (it tokenizes with it).
When some node lacks bytes of it, the coordinator serves Manifest and FetchRanges (nothing else)
on the address it reaches that node from, for as long as the ring lives, and names that address
in LoadPlan's fetch_sources. It answers over mutual TLS with this process's cluster identity, so
only cluster members fetch; without an identity it serves only on loopback. Every byte it sends
is checked by the fetching node against its hash and the model's fingerprint.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import grpc

from prima.errors import NodeError
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net import credentials
from prima.net.fetch import Manifest, manifest_of
from prima.net.server import start_file_server

log = logging.getLogger("prima.coordinator")


class CoordinatorFile:
    """The coordinator's whole model file, as the file servicer reads it."""

    def __init__(self, path: Path) -> None:
        self.gguf = GGUFFile(path)
        self.store = SparseFile.open(path, self.gguf.fingerprint())

    def manifest(self) -> Manifest:
        return manifest_of(self.store, str(self.gguf.metadata.get("general.name", "")), self.gguf.data_offset)

    def authorize(self, rpc: str, caller: str | None) -> None:
        """Any cluster member may fetch (the handshake proved membership); nothing else is served."""

    def close(self) -> None:
        self.store.close()
        self.gguf.close()


def address_towards(peer: str) -> str:
    """This device's address on the route to `peer` (host:port): what the peer can reach it at.
    Connecting a UDP socket sends nothing; it only asks the kernel for the route."""
    host, _, port = peer.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
        except OSError as exc:
            raise NodeError(f"no route to {peer} to serve the model file on ({exc.strerror})") from None
        return str(s.getsockname()[0])


class FileSource:
    """A running file server: `address` goes into LoadPlan's fetch_sources; `close` stops it."""

    def __init__(self, server: grpc.Server, address: str, held: CoordinatorFile) -> None:
        self.server = server
        self.address = address
        self._held = held

    @classmethod
    def start(cls, path: Path, towards: str) -> FileSource | None:
        """Serve `path` on the address `towards` (a node's host:port) reaches this device at;
        None (with the reason logged) when this process may not or cannot serve it."""
        if SparseFile.open(path).partial:
            log.info("%s holds only part of the model; the ring's nodes fetch from each other", path)
            return None
        host = address_towards(towards)
        identity = credentials.file_server_identity()
        if identity is None and credentials.client_identity() is not None:
            log.warning(
                "not serving %s to the ring: this device's certificate is a coordinator's, and only a "
                "node's may serve; the ring's nodes fetch from a daemon holding the file",
                path.name,
            )
            return None
        if identity is None and not credentials.is_loopback(host):
            log.warning(
                "not serving %s to the ring on %s: this device has no cluster identity (prima cluster "
                "issue), and the bytes go only to members over mutual TLS",
                path.name,
                host,
            )
            return None
        held = CoordinatorFile(path)
        server, port = start_file_server(held, host, 0, identity)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("serving the bytes of %s to the ring on %s", path.name, address)
        return cls(server, address, held)

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(5.0)
        self._held.close()
