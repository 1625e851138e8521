"""Seeded corruptions of a GGUF file's header, for the fuzz tests and the load probe: byte flips
(the fixed fields and first keys, the tensor infos, anywhere before the data), truncations, and
fields overwritten with edge values (0, 1, 2**31, 2**32, 2**63, 2**64 - 1, ...)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prima.model.gguf_file import GGUFFile

EDGE_U64 = (0, 1, 2, 3, 31, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)


@dataclass(frozen=True)
class Layout:
    """Where the header's parts sit in the original file."""

    size: int
    data_offset: int
    tensor_info_offset: int
    fields: tuple[tuple[int, int], ...]  # (position, width in bytes) of each tensor-info number


@dataclass(frozen=True)
class Corruption:
    kind: str
    at: int
    data: bytes = b""

    def __str__(self) -> str:
        return f"{self.kind} at byte {self.at}" + (f" <- {self.data.hex()}" if self.data else "")


def layout_of(path: Path) -> Layout:
    with GGUFFile(path) as gguf:
        start, data_offset = gguf.tensor_info_offset, gguf.data_offset
        n_tensors = len(gguf.tensors)
    raw = path.read_bytes()[:data_offset]
    fields = []
    pos = start
    for _ in range(n_tensors):  # name, n_dims, ne[n_dims], type, offset
        (n,) = struct.unpack_from("<Q", raw, pos)
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", raw, pos)
        fields.append((pos, 4))
        pos += 4
        fields.extend((pos + 8 * i, 8) for i in range(n_dims))
        pos += 8 * n_dims
        fields.append((pos, 4))
        fields.append((pos + 4, 8))
        pos += 12
    return Layout(os.path.getsize(path), data_offset, start, tuple(fields))


def edge(rng: np.random.Generator) -> int:
    return EDGE_U64[int(rng.integers(len(EDGE_U64)))]


def corruptions(layout: Layout, n: int, rng: np.random.Generator) -> list[Corruption]:
    out = []
    for _ in range(n):
        kind = rng.choice(
            ["flip-start", "flip-infos", "flip-any", "truncate", "field", "u64"],
            p=[0.2, 0.2, 0.15, 0.1, 0.25, 0.1],
        )
        if kind == "truncate":
            # Mostly inside the header, sometimes in the tensor data.
            end = layout.data_offset if rng.random() < 0.7 else layout.size
            out.append(Corruption("truncate", int(rng.integers(0, end))))
        elif kind == "field":
            pos, width = layout.fields[int(rng.integers(len(layout.fields)))]
            value = edge(rng) if rng.random() < 0.7 else int(rng.integers(0, 2**63))
            out.append(Corruption("field", pos, (value % 2 ** (8 * width)).to_bytes(width, "little")))
        elif kind == "u64":
            pos = int(rng.integers(0, layout.data_offset - 8))
            out.append(Corruption("u64", pos, edge(rng).to_bytes(8, "little")))
        else:
            lo, hi = {
                "flip-start": (0, min(4096, layout.data_offset)),
                "flip-infos": (layout.tensor_info_offset, layout.data_offset),
                "flip-any": (0, layout.data_offset),
            }[kind]
            out.append(Corruption("flip", int(rng.integers(lo, hi)), bytes([int(rng.integers(1, 256))])))
    return out


def apply(path: Path, c: Corruption) -> None:
    if c.kind == "truncate":
        os.truncate(path, c.at)
        return
    with open(path, "r+b") as fh:
        fh.seek(c.at)
        fh.write(c.data)


def restore_sparse(path: Path, layout: Layout, header: bytes, c: Corruption) -> None:
    """Put the original bytes back: the header from memory, the data as the hole it was."""
    with open(path, "r+b") as fh:
        if c.kind == "truncate":
            fh.truncate(layout.size)
            if c.at < len(header):
                fh.seek(c.at)
                fh.write(header[c.at :])
        elif c.at < len(header):
            fh.seek(c.at)
            fh.write(header[c.at : c.at + len(c.data)])
