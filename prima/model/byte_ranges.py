"""Which bytes of a GGUF file a node needs, as half-open byte ranges, and the arithmetic on them.

A node that holds only part of a model (prima.model.sparse) needs: the header (the GGUF index
every node parses at start), the pages the fingerprint samples (so its fingerprint is the whole
file's), the small tensors outside the layers (norms), the tensors of the layers in its windows,
and on the head node (node 0: it embeds and applies the output head) the token embedding and the
output head. Everything here is pure: ranges are frozen, sorted and merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prima.model.gguf_file import GGUFFile, fingerprint_spans
from prima.plan import Window

# Tensors only the head reads (embedding lookup, output head); every other non-layer tensor is
# small (norms, rope factors) and every node takes it.
HEAD_TENSORS = ("token_embd.weight", "output.weight")


@dataclass(frozen=True, order=True)
class ByteRange:
    """Bytes `[start, end)` of a file."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"byte range [{self.start}, {self.end}) is not a range")

    @property
    def n_bytes(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start},{self.end})"


Ranges = tuple[ByteRange, ...]


def normalize(ranges: Iterable[ByteRange | tuple[int, int]]) -> Ranges:
    """Sorted, with empty ranges dropped and touching or overlapping ones merged."""
    spans = sorted(r if isinstance(r, ByteRange) else ByteRange(*r) for r in ranges)
    merged: list[ByteRange] = []
    for r in spans:
        if not r.n_bytes:
            continue
        if merged and r.start <= merged[-1].end:
            merged[-1] = ByteRange(merged[-1].start, max(r.end, merged[-1].end))
        else:
            merged.append(r)
    return tuple(merged)


def total_bytes(ranges: Iterable[ByteRange]) -> int:
    return sum(r.n_bytes for r in normalize(ranges))


def subtract(want: Iterable[ByteRange], have: Iterable[ByteRange]) -> Ranges:
    """The bytes of `want` not in `have`."""
    holes = normalize(have)
    out: list[ByteRange] = []
    for r in normalize(want):
        start = r.start
        for h in holes:
            if h.end <= start or h.start >= r.end:
                continue
            if h.start > start:
                out.append(ByteRange(start, h.start))
            start = max(start, h.end)
        if start < r.end:
            out.append(ByteRange(start, r.end))
    return tuple(out)


def covers(have: Iterable[ByteRange], want: Iterable[ByteRange]) -> bool:
    return not subtract(want, have)


def intersect(a: Iterable[ByteRange], b: Iterable[ByteRange]) -> Ranges:
    """The bytes in both `a` and `b`."""
    na = normalize(a)
    return subtract(na, subtract(na, b))


def pieces(ranges: Iterable[ByteRange], max_bytes: int) -> Iterator[ByteRange]:
    """`ranges` cut into pieces of at most `max_bytes` (the unit sent, hashed and recorded), one
    at a time: a whole file in small pieces would be millions of objects at once."""
    if max_bytes <= 0:
        raise ValueError(f"piece size must be positive, got {max_bytes}")
    for r in normalize(ranges):
        for s in range(r.start, r.end, max_bytes):
            yield ByteRange(s, min(s + max_bytes, r.end))


def bootstrap_ranges(file_size: int, data_offset: int) -> Ranges:
    """What a node must hold before it can open the file at all: the header (the GGUF index) and
    the pages the fingerprint samples."""
    return normalize(fingerprint_spans(file_size, data_offset))


def _layer_of(name: str) -> int | None:
    """The layer index of a `blk.N.*` tensor name, None for tensors outside the layers."""
    if not name.startswith("blk."):
        return None
    index, _, _ = name[4:].partition(".")
    return int(index) if index.isdigit() else None


def needed_ranges(gguf: GGUFFile, windows: Sequence[Window], *, head: bool) -> Ranges:
    """The bytes a node computing `windows` needs (with the embedding and output head when it is
    the `head`): see the module docstring."""
    layers = {i for w in windows for i in range(w.start, w.end)}
    want: list[ByteRange] = list(bootstrap_ranges(gguf.file_size, gguf.data_offset))
    for name, info in gguf.tensors.items():
        layer = _layer_of(name)
        if layer is None and (head or name not in HEAD_TENSORS) or layer in layers:
            want.append(ByteRange(info.offset, info.offset + info.n_bytes))
    return normalize(want)


def held_layers(gguf: GGUFFile, held: Iterable[ByteRange]) -> tuple[int, ...]:
    """The layers every tensor byte of which is in `held`."""
    have = normalize(held)
    by_layer: dict[int, list[ByteRange]] = {}
    for name, info in gguf.tensors.items():
        layer = _layer_of(name)
        if layer is not None:
            by_layer.setdefault(layer, []).append(ByteRange(info.offset, info.offset + info.n_bytes))
    return tuple(sorted(layer for layer, want in by_layer.items() if covers(have, want)))


def holds_head_tensors(gguf: GGUFFile, held: Iterable[ByteRange]) -> bool:
    """Whether `held` has the embedding and output head (what only the head node reads)."""
    want = [
        ByteRange(info.offset, info.offset + info.n_bytes)
        for name, info in gguf.tensors.items()
        if name in HEAD_TENSORS
    ]
    return covers(held, want)
