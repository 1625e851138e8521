"""Moving a model's bytes between nodes: the Manifest and FetchRanges RPCs, both sides.

A node that holds only part of a model (prima.model.sparse) asks a peer for its Manifest (the
file's size, header length and fingerprint, and what the peer holds), then streams the byte
ranges it lacks with FetchRanges. The server cuts them into pieces of at most MAX_PIECE_BYTES and
sends each with its sha256; gRPC's flow control paces the stream to the writer. The client writes
a piece only once it matches its hash (a piece that does not is dropped and asked for again),
flushes its record every FLUSH_BYTES, and on a broken stream asks again for what is still missing,
so an interrupted transfer resumes without refetching what it has. Any cluster member may fetch
(the channel is mutual TLS); a node serves only bytes of its own model that it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from prima.errors import ModelFileError, NodeError, PrimaError, ProtocolError
from prima.model.byte_ranges import ByteRange, Ranges, bootstrap_ranges, covers, normalize, pieces, subtract
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import PieceHashError, SparseFile, sha256_hex
from prima.net.client import NodeClient, node_error
from prima.net.proto import prima_pb2 as pb
from prima.net.status import PayloadTooLargeError

log = logging.getLogger("prima.net")

DEFAULT_PIECE_BYTES = 1 << 20
MAX_PIECE_BYTES = 4 << 20  # well under the channels' 64 MiB message limit
# Smaller pieces cost the server a message, a hash and a gRPC frame each: 1-byte pieces of 8 MiB
# took 1.4 GiB and 16 s before the first byte.
MIN_PIECE_BYTES = 64 << 10
MAX_RANGES = 1 << 16  # ranges in one request (a node's windows need a few per layer at most)
FLUSH_BYTES = 64 << 20  # progress a crash may lose, to be fetched again
MAX_ATTEMPTS = 4  # streams per fetch: the first, then resumes after a break or bad pieces
STREAM_TIMEOUT_S = 3600.0  # deadline of one FetchRanges stream


@dataclass(frozen=True)
class Manifest:
    """What a node holds of its model file (see ModelManifest in prima.proto)."""

    model_name: str
    fingerprint: str
    file_size: int
    data_offset: int
    held: Ranges

    @property
    def complete(self) -> bool:
        return self.held == (ByteRange(0, self.file_size),)


def manifest_of(store: SparseFile, model_name: str, data_offset: int) -> Manifest:
    return Manifest(model_name, store.fingerprint, store.file_size, data_offset, store.held())


def manifest_to_proto(m: Manifest) -> pb.ModelManifest:
    msg = pb.ModelManifest(
        model_name=m.model_name,
        model_fingerprint=m.fingerprint,
        file_size=m.file_size,
        data_offset=m.data_offset,
        complete=m.complete,
    )
    if not m.complete:
        msg.held.extend(pb.ByteSpan(start=r.start, end=r.end) for r in m.held)
    return msg


def _ranges_from_proto(spans: object, file_size: int, what: str) -> Ranges:
    out = []
    for s in spans:  # type: ignore[attr-defined]
        if not s.start < s.end <= file_size:
            raise ProtocolError(
                f"{what} [{s.start},{s.end}) is not a range within the file's {file_size} bytes"
            )
        out.append(ByteRange(s.start, s.end))
    return normalize(out)


def manifest_from_proto(msg: pb.ModelManifest) -> Manifest:
    """A peer's manifest, checked for sense (ProtocolError otherwise)."""
    if not msg.model_fingerprint or not msg.file_size or not 0 < msg.data_offset <= msg.file_size:
        raise ProtocolError(
            f"manifest of a file of {msg.file_size} bytes with a header of {msg.data_offset} bytes "
            "and no fingerprint or an impossible size"
        )
    held = (
        (ByteRange(0, msg.file_size),)
        if msg.complete
        else _ranges_from_proto(msg.held, msg.file_size, "held span")
    )
    return Manifest(msg.model_name, msg.model_fingerprint, msg.file_size, msg.data_offset, held)


# -- serving -------------------------------------------------------------------------------------
def requested_pieces(request: pb.FetchRequest, manifest: Manifest) -> Iterator[ByteRange]:
    """The pieces to send for `request`, one at a time, after checking that it asks for this
    node's model, for at most MAX_RANGES ranges of the file, all held here, in pieces of at
    least MIN_PIECE_BYTES (0: the default)."""
    if request.model_fingerprint != manifest.fingerprint:
        raise ProtocolError(
            f"asked for bytes of model {request.model_fingerprint[:16]!r}, but this node serves "
            f"{manifest.model_name} ({manifest.fingerprint[:12]})"
        )
    if len(request.ranges) > MAX_RANGES:
        raise PayloadTooLargeError(f"{len(request.ranges)} ranges in one fetch; ask for at most {MAX_RANGES}")
    ranges = _ranges_from_proto(request.ranges, manifest.file_size, "requested range")
    if not ranges:
        raise ProtocolError("a fetch that asks for no bytes; name at least one range")
    lacking = subtract(ranges, manifest.held)
    if lacking:
        raise ProtocolError(
            f"this node does not hold {len(lacking)} of the requested ranges (first {lacking[0]}); "
            "fetch them from a node holding the whole file"
        )
    if 0 < request.piece_bytes < MIN_PIECE_BYTES:
        raise ProtocolError(
            f"piece_bytes {request.piece_bytes} is below the minimum of {MIN_PIECE_BYTES}; ask for 0 "
            f"(the default, {DEFAULT_PIECE_BYTES}) or {MIN_PIECE_BYTES} to {MAX_PIECE_BYTES}"
        )
    size = min(request.piece_bytes or DEFAULT_PIECE_BYTES, MAX_PIECE_BYTES)
    return pieces(ranges, size)


def piece_message(store: SparseFile, r: ByteRange) -> pb.FilePiece:
    data = store.read(r)
    return pb.FilePiece(offset=r.start, data=data, sha256=sha256_hex(data))


# -- fetching ------------------------------------------------------------------------------------
class FetchCancelled(PrimaError):
    """A fetch was called off (its plan was replaced, or the daemon stops); what it wrote is kept."""


@dataclass
class FetchStats:
    """What one fetch did: bytes wanted and written, pieces refused for their hash, streams."""

    wanted_bytes: int = 0
    written_bytes: int = 0
    bad_pieces: int = 0
    streams: int = 0


def get_manifest(client: NodeClient) -> Manifest:
    try:
        msg = client.stub.Manifest(pb.ManifestRequest(), timeout=client.timeout_s)
        return manifest_from_proto(msg)
    except grpc.RpcError as exc:
        raise node_error(client.name, client.address, exc, "Manifest") from None
    except ProtocolError as exc:
        raise NodeError(f"node {client.name} at {client.address} sent an unusable manifest: {exc}") from None


def fetch_into(
    client: NodeClient,
    store: SparseFile,
    ranges: Ranges,
    *,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    max_attempts: int = MAX_ATTEMPTS,
    on_progress: Callable[[FetchStats], None] | None = None,
    cancel: threading.Event | None = None,
) -> FetchStats:
    """Bring every byte of `ranges` into `store` from `client`'s node, asking each time only for
    what is still missing; NodeError if after `max_attempts` streams some is still missing,
    FetchCancelled (between pieces) once `cancel` is set."""
    stats = FetchStats(wanted_bytes=sum(r.n_bytes for r in subtract(ranges, store.held())))
    last: Exception | None = None
    for _ in range(max_attempts):
        missing = subtract(ranges, store.held())
        if not missing:
            return stats
        stats.streams += 1
        try:
            _one_stream(client, store, missing, piece_bytes, stats, on_progress, cancel)
        except NodeError as exc:
            last = exc
            log.warning("fetch from %s broke off (%s); resuming", client.address, exc)
        finally:
            store.flush()
    missing = subtract(ranges, store.held())
    if not missing:
        return stats
    raise NodeError(
        f"could not fetch {sum(r.n_bytes for r in missing)} bytes of {store.path.name} from node "
        f"{client.name} at {client.address} in {max_attempts} attempts"
        + (f" (last: {last})" if last else f" ({stats.bad_pieces} pieces failed their hash)")
    )


def _one_stream(
    client: NodeClient,
    store: SparseFile,
    missing: Ranges,
    piece_bytes: int,
    stats: FetchStats,
    on_progress: Callable[[FetchStats], None] | None,
    cancel: threading.Event | None,
) -> None:
    request = pb.FetchRequest(
        model_fingerprint=store.fingerprint,
        ranges=[pb.ByteSpan(start=r.start, end=r.end) for r in missing],
        piece_bytes=piece_bytes,
    )
    call = client.stub.FetchRanges(request, timeout=STREAM_TIMEOUT_S)
    unflushed = 0
    try:
        for msg in call:
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(f"fetch of {store.path.name} from {client.address} called off")
            r = ByteRange(msg.offset, msg.offset + len(msg.data))
            if not r.n_bytes or r.n_bytes > piece_bytes or not covers(missing, [r]):
                raise NodeError(
                    f"node {client.name} at {client.address} sent bytes {r} that were not asked for"
                )
            try:
                store.write(r.start, msg.data, msg.sha256)
            except PieceHashError:
                stats.bad_pieces += 1  # still missing: the next stream asks for it again
                log.warning("piece %s from %s failed its sha256; will fetch it again", r, client.address)
                continue
            stats.written_bytes += r.n_bytes
            unflushed += r.n_bytes
            if unflushed >= FLUSH_BYTES:
                store.flush()
                unflushed = 0
            if on_progress:
                on_progress(stats)
    except grpc.RpcError as exc:
        raise node_error(client.name, client.address, exc, "FetchRanges") from None
    finally:
        call.cancel()


def bootstrap(path: Path, source: NodeClient) -> SparseFile:
    """Make `path` a sparse copy of the model `source` serves, holding at least its header and
    the pages its fingerprint samples, and check that fingerprint; what `path` already holds of
    that model is kept (a sparse file of another model is replaced)."""
    manifest = get_manifest(source)
    store: SparseFile | None = None
    if path.exists():
        try:
            store = SparseFile.open(path)
        except ModelFileError as exc:
            log.warning("%s; starting it again", exc)
        if store is not None and not store.partial:
            return _whole_file(path, manifest)
        if store is not None and (store.fingerprint, store.file_size) != (
            manifest.fingerprint,
            manifest.file_size,
        ):
            log.warning("%s holds part of another model; replacing it with %s", path, manifest.model_name)
            store = None
    if store is None:
        store = SparseFile.create(path, manifest.fingerprint, manifest.file_size)
    t0 = time.monotonic()
    fetch_into(source, store, bootstrap_ranges(manifest.file_size, manifest.data_offset))
    with GGUFFile(path) as gguf:
        found = gguf.fingerprint()
    if found != manifest.fingerprint:
        raise ModelFileError(
            f"{path}: the fetched header has fingerprint {found[:12]}, not {manifest.fingerprint[:12]} "
            f"as node {source.name} said; delete {path} and its .held record and start again"
        )
    log.info("%s: header of %s in %.1f s", path, manifest.model_name, time.monotonic() - t0)
    return store


def _whole_file(path: Path, manifest: Manifest) -> SparseFile:
    """A whole model file already at `path`: used as it is if it is the model asked for, never
    overwritten if it is not."""
    with GGUFFile(path) as gguf:
        found = gguf.fingerprint()
    if found != manifest.fingerprint:
        raise ModelFileError(
            f"{path} is a whole model file of another model ({found[:12]}, not {manifest.model_name} "
            f"{manifest.fingerprint[:12]}); give --model another path to fetch into"
        )
    return SparseFile.open(path, found)
