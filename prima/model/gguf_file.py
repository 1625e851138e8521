"""Index of a GGUF file: metadata and tensor views over one read-only mmap.

gguf-py's `GGUFReader` builds a Python object per array element, which takes ~14 s on a
262k-token vocabulary; a daemon must start in well under a second, so the header is parsed
here with `struct` and numpy, using gguf-py's enums and block sizes as the source of truth.
Every count, length and tensor is checked before it is used, with Python's unbounded ints so no
product or sum can wrap: a tensor's dimensions, its type, and its byte range (aligned, inside the
file, not overlapping another); a file that fails says which tensor and what is wrong.
Tensor data is never copied: every tensor is a numpy view into the file's mmap, so weights live
in the OS page cache and the OS may reclaim them under pressure. String arrays (the vocabulary and
its merges) stay there too, as `StringArray`s decoded on access.
"""

from __future__ import annotations

import array
import hashlib
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from prima.errors import ModelFileError
from prima.ggml_constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
# Sanity bounds so a hostile header cannot make us allocate the world.
_MAX_STRING_BYTES = 1 << 26
_MAX_COUNT = 1 << 31
_ITER_CHUNK = 4096  # strings decoded per slice of the header when iterating a StringArray
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. `shape` is in numpy order (ggml's ne reversed),
    so a 2-D weight is (rows = output features, cols = input features)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class StringArray(Sequence[str]):
    """A GGUF array of strings, decoded on access from the mapped header: one offset per string
    instead of a Python str each (a 49k-token vocabulary and its merges hold ~8 MiB as strs,
    and for a 262k-token one the list alone would be ~20 MiB)."""

    def __init__(self, data: np.ndarray, starts: np.ndarray) -> None:
        # String i is data[starts[i] : starts[i + 1] - 8]: each is followed by the next one's
        # u64 length, and the last entry of `starts` sits 8 bytes past the end of the last string.
        self._data = data
        self._starts = starts

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"string index {i} out of range for {n} strings")
        start, end = int(self._starts[i]), int(self._starts[i + 1]) - 8
        return self._data[start:end].tobytes().decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        # In chunks: the offsets of a whole 262k vocabulary as Python ints would be ~10 MiB at
        # once, freed only into the allocator's free lists (resident all the same).
        for first in range(0, len(self), _ITER_CHUNK):
            starts = self._starts[first : first + _ITER_CHUNK + 1]
            base = int(starts[0])
            raw = self._data[base : int(starts[-1]) - 8].tobytes()
            offsets = (starts - base).tolist()
            for start, nxt in zip(offsets, offsets[1:], strict=False):
                yield raw[start : nxt - 8].decode("utf-8", errors="replace")

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        lengths = np.diff(self._starts) - 8  # only strings of the same UTF-8 length can be equal
        return any(self[i] == value for i in np.flatnonzero(lengths == len(value.encode("utf-8"))).tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self.digest() == other.digest()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"

    def digest(self) -> bytes:
        """SHA-256 of the strings as stored (with their length prefixes): equal digests, equal arrays."""
        if not len(self):
            return hashlib.sha256(b"").digest()
        start, end = int(self._starts[0]) - 8, int(self._starts[-1]) - 8
        return hashlib.sha256(self._data[start:end]).digest()


class _Cursor:
    """Bounds-checked little-endian reader over the mapped header."""

    def __init__(self, buf: memoryview, path: Path, array: np.ndarray) -> None:
        self.buf = buf
        self.array = array  # the same bytes as a uint8 array, for StringArray views
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: the GGUF header is truncated at byte {self.pos} "
                f"(wanted {n} more bytes, file has {len(self.buf)}); re-download the model"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar("<I")

    def u64(self) -> int:
        return self.scalar("<Q")

    def count(self, what: str) -> int:
        n = self.u64()
        if n > _MAX_COUNT:
            raise ModelFileError(f"{self.path}: implausible {what} count {n}; the file is corrupt")
        return n

    def string(self) -> str:
        n = self.u64()
        if n > _MAX_STRING_BYTES:
            raise ModelFileError(f"{self.path}: implausible string length {n}; the file is corrupt")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        try:
            kind = GGUFValueType(vtype)
        except ValueError:
            raise ModelFileError(
                f"{self.path}: unknown metadata value type {vtype}; the file is corrupt"
            ) from None
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            raw_type = self.u32()
            try:
                item_type = GGUFValueType(raw_type)
            except ValueError:
                raise ModelFileError(
                    f"{self.path}: unknown array item type {raw_type} at byte {self.pos - 4}; the file is corrupt"
                ) from None
            if item_type == GGUFValueType.ARRAY:  # as llama.cpp: no arrays of arrays
                raise ModelFileError(
                    f"{self.path}: an array of arrays at byte {self.pos - 4}; the file is corrupt"
                )
            n = self.count("array")
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                self.need(n * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
                self.pos += n * dtype.itemsize
                return arr.astype(bool) if item_type == GGUFValueType.BOOL else arr
            if item_type == GGUFValueType.STRING:
                return self.strings(n)
            self.need(n)  # at least a byte per item before a list of n is built
            return [self.value(item_type) for _ in range(n)]
        return self.scalar(_SCALAR_FORMATS[kind])

    def strings(self, n: int) -> StringArray:
        """n length-prefixed strings, indexed but not decoded. The loop is as bare as it can be
        (a 262k-token vocabulary runs it 262k times per open): reading past the end raises
        struct.error, and lengths are checked together afterwards."""
        self.need(8 * n)  # each string has its 8-byte length at least: check before allocating
        unpack = struct.Struct("<Q").unpack_from
        buf, pos = self.buf, self.pos
        # int64 slots, not a list: a list holds a Python int per string (~3.6 MiB for SmolLM2's
        # tokens and merges), whose freed memory stayed in the process's heap (peak RSS).
        starts = array.array("q", bytes(8 * (n + 1)))
        try:
            for i in range(n):
                (count,) = unpack(buf, pos)
                pos += 8
                starts[i] = pos
                pos += count
        except (struct.error, OverflowError):  # OverflowError: an offset past 2**63
            raise ModelFileError(
                f"{self.path}: the GGUF header is truncated in an array of {n} strings "
                f"(file has {len(buf)} bytes); re-download the model"
            ) from None
        self.pos = pos
        self.need(0)  # the last string ends inside the file
        starts[n] = pos + 8
        index = np.frombuffer(starts, dtype=np.int64)
        if n and int((np.diff(index) - 8).max()) > _MAX_STRING_BYTES:
            raise ModelFileError(
                f"{self.path}: implausible string length in a string array; the file is corrupt"
            )
        return StringArray(self.array, index.astype(np.uint32) if pos < 1 << 31 else index)


FINGERPRINT_SAMPLES = 16  # pages of the file hashed into its fingerprint


def fingerprint_spans(file_size: int, data_offset: int) -> list[tuple[int, int]]:
    """The byte spans `[start, end)` GGUFFile.fingerprint hashes, in order: the header, then a
    page at each of FINGERPRINT_SAMPLES points spread over the file. A node holding only part of
    the file (prima.model.sparse) fetches these too, so its fingerprint is the whole file's."""
    spans = [(0, data_offset)]
    for i in range(FINGERPRINT_SAMPLES):
        at = file_size * i // FINGERPRINT_SAMPLES
        spans.append((at, min(at + 4096, file_size)))
    return spans


class GGUFFile:
    """A GGUF model file opened read-only: `metadata` (decoded key/values), `tensors` (index by
    name), and `tensor_bytes(name)` / `tensor_array(name)` as zero-copy views into the mmap."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(f"{self.path}: no such model file; pass a GGUF path or a model name")
        if self.path.is_dir():
            raise ModelFileError(f"{self.path}: is a directory, not a GGUF model file")
        self.file_size = self.path.stat().st_size
        if self.file_size < 24:
            raise ModelFileError(f"{self.path}: only {self.file_size} bytes, too short to be a GGUF file")
        with open(self.path, "rb") as fh:
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mmap, dtype=np.uint8)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()
        self.release_header_pages()  # a node that never tokenizes never reads them again

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._mmap), self.path, self.data)
        cur.need(4)
        magic = bytes(cur.buf[0:4])
        cur.pos = 4
        if magic != GGUF_MAGIC:
            raise ModelFileError(
                f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                "prima reads llama.cpp GGUF models"
            )
        self.version = cur.u32()
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelFileError(
                f"{self.path}: GGUF version {self.version} is not supported (supported: {SUPPORTED_VERSIONS})"
            )
        n_tensors = cur.count("tensor")
        n_kv = cur.count("metadata")
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.u32())

        self.tensor_info_offset = cur.pos
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed); "
                    "the file is corrupt"
                )
            ne = tuple(cur.u64() for _ in range(n_dims))
            qtype = cur.u32()
            rel_offset = cur.u64()
            infos.append((name, ne, qtype, rel_offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{self.path}: invalid general.alignment {alignment!r}; the file is corrupt")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.data_offset = data_start

        for name, ne, qtype_id, rel_offset in infos:
            if name in self.tensors:
                raise ModelFileError(f"{self.path}: tensor {name!r} appears twice; the file is corrupt")
            self.tensors[name] = self._tensor_info(name, ne, qtype_id, rel_offset, alignment)
        self._check_overlaps(alignment)

    def _tensor_info(
        self, name: str, ne: tuple[int, ...], qtype_id: int, rel_offset: int, alignment: int
    ) -> TensorInfo:
        """One tensor's geometry, checked: dimensions >= 1, rows whole blocks of a known type,
        an aligned offset, and its bytes inside the file. Python ints throughout, so an ne of
        2**63 stays 2**63 instead of wrapping to 0."""
        where = f"{self.path}: tensor {name!r}"
        if any(d < 1 for d in ne):
            raise ModelFileError(f"{where} has a dimension of 0 (ne={list(ne)}); the file is corrupt")
        shape = tuple(reversed(ne))
        offset = self.data_offset + rel_offset
        if rel_offset % alignment:
            raise ModelFileError(
                f"{where} starts at data offset {rel_offset}, not a multiple of the alignment {alignment}; "
                "the file is corrupt"
            )
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            qtype = None
        if qtype is None or qtype not in GGML_QUANT_SIZES:
            # Unknown type: record it with zero size; the model loader names it to the user.
            if offset > self.file_size:
                raise ModelFileError(f"{where} starts past the end of the file; the file is corrupt")
            return TensorInfo(name, qtype_id, shape, offset, 0)  # type: ignore[arg-type]
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        if ne[0] % block_elems:
            raise ModelFileError(
                f"{where} has rows of {ne[0]} elements, not a multiple of the {qtype.name} block size "
                f"{block_elems}; the file is corrupt"
            )
        n_bytes = math.prod(ne) // block_elems * block_bytes
        if offset + n_bytes > self.file_size:
            raise ModelFileError(
                f"{where} ({qtype.name}, shape {list(shape)}) would end at byte {offset + n_bytes} but the "
                f"file has {self.file_size} bytes: it is truncated or corrupt; re-download the model"
            )
        return TensorInfo(name, qtype, shape, offset, n_bytes)

    def _check_overlaps(self, alignment: int) -> None:
        """The tensors tile the data section: no two share bytes (a corrupt offset must not alias
        another tensor's weights), and none is followed by more than alignment padding. Writers
        (gguf-py, llama.cpp) pack tensors back to back; bytes no tensor claims mean the table does
        not describe the data, e.g. a tensor retyped to a smaller type (F32 read as BF16)."""
        spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in self.tensors.values() if t.n_bytes)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ModelFileError(
                    f"{self.path}: tensors {first!r} and {second!r} overlap (bytes from {start} to {end}); "
                    "the file is corrupt"
                )
            if start - end >= alignment:
                raise ModelFileError(
                    f"{self.path}: {start - end} bytes between tensors {first!r} and {second!r} belong to "
                    f"no tensor (at most {alignment - 1} of padding are expected): the tensor table does not "
                    "describe the data (a tensor's type or shape changed?); the file is corrupt, re-download it"
                )

    # -- access --------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def fingerprint(self) -> str:
        """sha256 over the file size, the header and a few pages spread over the file: cheap (no
        full read) and equal for copies of one file on different devices, so nodes and the
        coordinator can check they run the same model."""
        data = self.data
        h = hashlib.sha256(str(data.size).encode())
        for start, end in fingerprint_spans(data.size, self.data_offset):
            h.update(data[start:end].tobytes())
        return h.hexdigest()

    def release_header_pages(self) -> int:
        """Drop this process's resident pages of the header (metadata, the vocabulary's strings)
        below the first tensor's page; returns the bytes advised, 0 where madvise is missing.
        Parsing and indexing the vocabulary read every one of them (SmolLM2's ~2 MiB, Gemma's
        several) and peak RSS would count them for the process's life; the mapping is read-only,
        so a later access (a token's text) refaults the page from the page cache unchanged."""
        end = self.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        if end == 0 or self._mmap.closed or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        self._mmap.madvise(mmap.MADV_DONTNEED, 0, end)
        return end

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor `name` shaped (rows, row_bytes): a view, never a copy."""
        info = self.tensors[name]
        raw = self.data[info.offset : info.offset + info.n_bytes]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return raw.reshape(rows, info.n_bytes // rows)

    def tensor_array(self, name: str) -> np.ndarray:
        """An F32/F16/BF16-as-uint16 tensor as a typed view in numpy shape."""
        info = self.tensors[name]
        dtypes = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.BF16: np.uint16,
        }
        if info.qtype not in dtypes:
            raise TypeError(f"tensor {name} is {info.qtype.name}, not a plain float type")
        raw = self.data[info.offset : info.offset + info.n_bytes]
        return raw.view(dtypes[info.qtype]).reshape(info.shape)

    def byte_range(self, names: list[str]) -> tuple[int, int]:
        """The [start, end) byte span covering the named tensors (for prefetch and residency)."""
        infos = [self.tensors[n] for n in names]
        return min(i.offset for i in infos), max(i.offset + i.n_bytes for i in infos)

    def close(self) -> None:
        self.data = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # Views are still alive elsewhere; the mapping is released when they are collected.
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def metadata_get(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Read a metadata key, turning one-element numpy arrays into scalars."""
    value = meta.get(key, default)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value
