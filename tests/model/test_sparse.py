"""A sparse model file: pieces are verified before they are written, recorded so a restart
knows what it holds, take disk blocks only where written, and bytes changed on disk are found."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from prima.errors import ModelFileError
from prima.model.byte_ranges import ByteRange
from prima.model.sparse import PieceHashError, SparseFile, sidecar_path

SIZE = 64 << 20
MIB = 1 << 20


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _piece(i: int, n: int = MIB) -> bytes:
    return bytes([i % 251 + 1]) * n


def test_a_new_sparse_file_takes_no_blocks_and_grows_by_what_is_written(tmp_path: Path) -> None:
    f = SparseFile.create(tmp_path / "m.gguf", "ab" * 32, SIZE)
    assert f.path.stat().st_size == SIZE
    assert f.allocated_bytes() < MIB
    for i in (3, 4, 40):
        f.write(i * MIB, _piece(i), _sha(_piece(i)))
    f.flush()
    assert f.held() == (ByteRange(3 * MIB, 5 * MIB), ByteRange(40 * MIB, 41 * MIB))
    assert 3 * MIB <= f.allocated_bytes() < 4 * MIB
    f.close()


def test_the_record_survives_a_restart_and_ignores_a_torn_line(tmp_path: Path) -> None:
    f = SparseFile.create(tmp_path / "m.gguf", "cd" * 32, SIZE)
    f.write(0, _piece(0), _sha(_piece(0)))
    f.write(MIB, _piece(1), _sha(_piece(1)))
    f.close()
    with open(sidecar_path(f.path), "a", encoding="utf-8") as fh:
        fh.write('{"start": 5, "end"')  # a crash mid-append
    again = SparseFile.open(f.path)
    assert again.fingerprint == "cd" * 32
    assert again.held() == (ByteRange(0, 2 * MIB),)
    assert again.read(ByteRange(MIB, MIB + 4)) == _piece(1, 4)


def test_unflushed_pieces_are_not_recorded(tmp_path: Path) -> None:
    f = SparseFile.create(tmp_path / "m.gguf", "ef" * 32, SIZE)
    f.write(0, _piece(0), _sha(_piece(0)))
    assert f.held_bytes() == MIB
    assert SparseFile.open(f.path).held_bytes() == 0  # as after a crash before the flush


def test_a_piece_that_does_not_match_its_hash_is_not_written(tmp_path: Path) -> None:
    f = SparseFile.create(tmp_path / "m.gguf", "01" * 32, SIZE)
    bad = bytearray(_piece(2))
    good_hash = _sha(bytes(bad))
    bad[1000] ^= 1
    with pytest.raises(PieceHashError):
        f.write(2 * MIB, bytes(bad), good_hash)
    assert f.held_bytes() == 0
    assert f.allocated_bytes() < MIB


def test_bytes_changed_on_disk_are_dropped_from_the_record(tmp_path: Path) -> None:
    f = SparseFile.create(tmp_path / "m.gguf", "23" * 32, SIZE)
    for i in range(4):
        f.write(i * MIB, _piece(i), _sha(_piece(i)))
    f.close()
    with open(f.path, "r+b") as fh:  # one flipped byte in piece 2
        fh.seek(2 * MIB + 77)
        fh.write(b"\x00")
    f = SparseFile.open(f.path)
    assert f.verify((ByteRange(0, 4 * MIB),)) == (ByteRange(2 * MIB, 3 * MIB),)
    assert f.held() == (ByteRange(0, 2 * MIB), ByteRange(3 * MIB, 4 * MIB))
    assert SparseFile.open(f.path).held() == f.held()


def test_a_file_without_a_record_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "whole.gguf"
    path.write_bytes(b"x" * 1000)
    f = SparseFile.open(path, "fp")
    assert f.complete
    assert f.held() == (ByteRange(0, 1000),)
    with pytest.raises(ModelFileError, match="whole model file"):
        f.write(0, b"y", _sha(b"y"))


def test_a_record_of_another_size_is_refused(tmp_path: Path) -> None:
    f = SparseFile.create(tmp_path / "m.gguf", "45" * 32, SIZE)
    with open(f.path, "r+b") as fh:
        fh.truncate(SIZE // 2)
    with pytest.raises(ModelFileError, match="delete both"):
        SparseFile.open(f.path)
