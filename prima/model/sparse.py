"""A model file that may hold only some of its bytes, and the record of which it holds.

A device with little storage keeps only the bytes of its own windows (prima.model.byte_ranges),
fetched from a peer (prima.net.fetch), at the same offsets as in the whole file: the file has the
whole file's size and holes elsewhere, so the mmap, the layer windows, prefetch/release and
mincore work on it unchanged, and the holes take no disk blocks.

Which bytes it holds is recorded in a sidecar file next to it (`<file>.held`, JSON lines): a
header line with the model's fingerprint and size, then one line per verified piece with its
sha256. The data is synced before its records are appended, so a record never claims bytes the
disk may not have; a crash loses at most the pieces since the last flush, which a restart fetches
again. A file with no sidecar is a whole model file and holds every byte.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from prima.errors import ModelFileError
from prima.model.byte_ranges import ByteRange, Ranges, intersect, normalize

log = logging.getLogger("prima.model")

SIDECAR_SUFFIX = ".held"
FORMAT = 1


class PieceHashError(ModelFileError):
    """Bytes of a model file do not match the hash they came with (or were recorded with)."""


@dataclass(frozen=True)
class HeldPiece:
    """Bytes `[start, end)` written and verified against `sha256` (hex)."""

    start: int
    end: int
    sha256: str

    @property
    def range(self) -> ByteRange:
        return ByteRange(self.start, self.end)


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class SparseFile:
    """A model file and what it holds: every byte (`complete`, no sidecar), or the verified
    pieces in its sidecar. `write` verifies and writes pieces; `flush` makes them durable."""

    def __init__(
        self, path: Path, fingerprint: str, file_size: int, pieces: dict[int, HeldPiece] | None
    ) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.file_size = file_size
        self._pieces = pieces  # None: the whole file, no sidecar
        self._pending: list[HeldPiece] = []
        self._lock = threading.Lock()
        self._fd: int | None = None

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], fingerprint: str = "") -> SparseFile:
        """The file at `path` as it is: partial if it has a sidecar, else whole (`fingerprint`
        is then the caller's, from GGUFFile.fingerprint)."""
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"{path}: no such model file")
        side = sidecar_path(path)
        if not side.exists():
            return cls(path, fingerprint, path.stat().st_size, None)
        header, pieces = _read_sidecar(side)
        size = path.stat().st_size
        if header["file_size"] != size:
            raise ModelFileError(
                f"{path}: is {size} bytes but its record {side.name} says {header['file_size']}; "
                f"delete both to fetch the model again"
            )
        return cls(path, str(header["fingerprint"]), size, pieces)

    @classmethod
    def create(cls, path: str | os.PathLike[str], fingerprint: str, file_size: int) -> SparseFile:
        """An empty sparse file of `file_size` bytes (all holes) for the model `fingerprint`,
        replacing whatever was at `path`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        side = sidecar_path(path)
        side.unlink(missing_ok=True)  # first: a file without its record would read as whole
        with open(path, "wb") as fh:
            fh.truncate(file_size)
        header = {"format": FORMAT, "fingerprint": fingerprint, "file_size": file_size}
        _write_atomic(side, json.dumps(header) + "\n")
        log.info("%s: new sparse file of %d bytes for model %s", path, file_size, fingerprint[:12])
        return cls(path, fingerprint, file_size, {})

    # -- what it holds ---------------------------------------------------------------------------
    @property
    def partial(self) -> bool:
        """Whether this file has a record of pieces (it may hold every byte by now)."""
        return self._pieces is not None

    @property
    def complete(self) -> bool:
        return self._pieces is None or self.held_bytes() == self.file_size

    def held(self) -> Ranges:
        if self._pieces is None:
            return (ByteRange(0, self.file_size),)
        with self._lock:
            return normalize(p.range for p in self._pieces.values())

    def held_bytes(self) -> int:
        return sum(r.n_bytes for r in self.held())

    def allocated_bytes(self) -> int:
        """Disk space the file takes (its allocated blocks): about `held_bytes` when sparse."""
        return self.path.stat().st_blocks * 512

    # -- reading and writing ---------------------------------------------------------------------
    def _handle(self) -> int:
        if self._fd is None:
            mode = os.O_RDONLY if self._pieces is None else os.O_RDWR
            self._fd = os.open(self.path, mode)
        return self._fd

    def read(self, r: ByteRange) -> bytes:
        """Bytes `r` as on disk (the caller checks that they are held)."""
        data = os.pread(self._handle(), r.n_bytes, r.start)
        if len(data) != r.n_bytes:
            raise ModelFileError(f"{self.path}: short read at {r} ({len(data)} bytes); was it truncated?")
        return data

    def write(self, start: int, data: bytes, sha256: str) -> None:
        """Write a piece at `start` once it matches `sha256` (PieceHashError otherwise, and nothing
        is written); it counts as held now and is recorded at the next `flush`."""
        if self._pieces is None:
            raise ModelFileError(f"{self.path}: is a whole model file; it takes no fetched pieces")
        piece = HeldPiece(start, start + len(data), sha256)
        if piece.end > self.file_size:
            raise ModelFileError(f"{self.path}: piece {piece.range} runs past its {self.file_size} bytes")
        if sha256_hex(data) != sha256:
            raise PieceHashError(f"{self.path}: the bytes for {piece.range} do not match their sha256")
        if os.pwrite(self._handle(), data, start) != len(data):
            raise ModelFileError(f"{self.path}: short write at {piece.range}; is the disk full?")
        with self._lock:
            self._pieces[start] = piece
            self._pending.append(piece)

    def flush(self) -> None:
        """Sync the written data, then append the records of the pieces written since the last
        flush: a record never names bytes the disk may not hold."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        os.fdatasync(self._handle())
        lines = "".join(
            json.dumps({"start": p.start, "end": p.end, "sha256": p.sha256}) + "\n" for p in pending
        )
        with open(sidecar_path(self.path), "a", encoding="utf-8") as fh:
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())

    def verify(self, ranges: Ranges) -> Ranges:
        """Re-hash the held pieces that overlap `ranges`; drop those whose bytes changed on disk
        (they are then fetched again) and return them. A whole file is not checked here."""
        if self._pieces is None:
            return ()
        with self._lock:
            pieces = [p for p in self._pieces.values() if intersect([p.range], ranges)]
        bad = [p for p in pieces if sha256_hex(self.read(p.range)) != p.sha256]
        if bad:
            log.warning(
                "%s: %d piece(s) changed on disk since fetched; fetching them again", self.path, len(bad)
            )
            self.flush()
            with self._lock:
                for p in bad:
                    self._pieces.pop(p.start, None)
                self._rewrite_sidecar()
        return normalize(p.range for p in bad)

    def _rewrite_sidecar(self) -> None:
        assert self._pieces is not None
        header = {"format": FORMAT, "fingerprint": self.fingerprint, "file_size": self.file_size}
        lines = [json.dumps(header)]
        lines += [
            json.dumps({"start": p.start, "end": p.end, "sha256": p.sha256}) for p in self._pieces.values()
        ]
        _write_atomic(sidecar_path(self.path), "\n".join(lines) + "\n")

    def close(self) -> None:
        """Flush what was written and close the file."""
        if self._fd is None:
            return
        if self._pieces is not None:
            self.flush()
        os.close(self._fd)
        self._fd = None


def _read_sidecar(side: Path) -> tuple[dict[str, int | str], dict[int, HeldPiece]]:
    """The sidecar's header and pieces. A torn last line (a crash mid-append) is ignored: its
    piece is fetched again."""
    lines = side.read_text(encoding="utf-8").splitlines()
    try:
        raw = json.loads(lines[0])
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')}")
        header: dict[str, int | str] = {
            "fingerprint": str(raw["fingerprint"]),
            "file_size": int(raw["file_size"]),
        }
    except (IndexError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelFileError(
            f"{side}: not a record prima can read ({exc}); delete it and its model file to fetch again"
        ) from None
    pieces: dict[int, HeldPiece] = {}
    for n, line in enumerate(lines[1:], start=2):
        try:
            raw = json.loads(line)
            piece = HeldPiece(int(raw["start"]), int(raw["end"]), str(raw["sha256"]))
            ByteRange(piece.start, piece.end)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s: line %d unreadable (%s); its bytes will be fetched again", side, n, exc)
            continue
        pieces[piece.start] = piece
    return header, pieces


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def held_bytes(path: Path) -> tuple[int, int]:
    """(bytes held, file size) of the model file at `path`, for listings."""
    f = SparseFile.open(path)
    return f.held_bytes(), f.file_size
