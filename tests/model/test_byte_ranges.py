"""Range arithmetic, and the bytes a node needs for its windows: the header and fingerprint
pages, its layers' tensors, and the embedding and output head only on the head."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.model.byte_ranges import (
    ByteRange,
    bootstrap_ranges,
    covers,
    held_layers,
    holds_head_tensors,
    intersect,
    needed_ranges,
    normalize,
    pieces,
    subtract,
    total_bytes,
)
from prima.model.gguf_file import GGUFFile
from prima.plan import Window
from tests.tiny_models import write_tiny_model


def R(start: int, end: int) -> ByteRange:
    return ByteRange(start, end)


def test_normalize_merges_touching_and_drops_empty() -> None:
    assert normalize([(5, 9), (0, 2), (2, 3), (7, 12), (20, 20)]) == (R(0, 3), R(5, 12))


def test_subtract_cuts_holes() -> None:
    assert subtract([R(0, 100)], [R(10, 20), R(50, 60), R(90, 200)]) == (R(0, 10), R(20, 50), R(60, 90))
    assert subtract([R(0, 10)], []) == (R(0, 10),)
    assert subtract([R(0, 10)], [R(0, 10)]) == ()
    assert covers([R(0, 5), R(5, 10)], [R(2, 8)])
    assert intersect([R(0, 10), R(20, 30)], [R(5, 25)]) == (R(5, 10), R(20, 25))


def test_pieces_are_bounded_and_cover_the_ranges() -> None:
    got = list(pieces([R(0, 10), R(15, 18)], 4))
    assert got == [R(0, 4), R(4, 8), R(8, 10), R(15, 18)]
    assert total_bytes(got) == 13


def test_a_range_is_half_open_and_ordered() -> None:
    with pytest.raises(ValueError, match="not a range"):
        ByteRange(5, 4)


def test_needed_ranges_hold_the_windows_and_the_head_only_on_the_head(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", n_layers=4)
    gguf = GGUFFile(path)
    span = {n: R(t.offset, t.offset + t.n_bytes) for n, t in gguf.tensors.items()}
    follower = needed_ranges(gguf, [Window(1, 3)], head=False)
    head = needed_ranges(gguf, [Window(0, 1), Window(3, 4)], head=True)
    assert covers(follower, bootstrap_ranges(gguf.file_size, gguf.data_offset))
    for name, r in span.items():
        if name.startswith(("blk.1.", "blk.2.")) or name == "output_norm.weight":
            assert covers(follower, [r]), name
        else:  # at most the fingerprint's sample pages of other tensors
            assert total_bytes(intersect([r], follower)) <= 16 * 4096, name
        if name.startswith(("blk.0.", "blk.3.")) or name in ("token_embd.weight", "output_norm.weight"):
            assert covers(head, [r]), name
    assert not covers(follower, [span["token_embd.weight"]])
    assert not covers(follower, [span["blk.0.attn_q.weight"]])
    # Together the two nodes need every tensor.
    assert covers(normalize([*follower, *head]), span.values())
    gguf.close()


def test_held_layers_are_those_whose_every_tensor_is_held(tmp_path: Path) -> None:
    """What a node reports to Halda from its sparse file's record."""
    path = write_tiny_model(tmp_path / "m.gguf", n_layers=4)
    gguf = GGUFFile(path)
    follower = needed_ranges(gguf, [Window(1, 3)], head=False)
    assert held_layers(gguf, follower) == (1, 2)
    assert not holds_head_tensors(gguf, follower)
    head = needed_ranges(gguf, [Window(0, 1), Window(3, 4)], head=True)
    assert held_layers(gguf, head) == (0, 3)
    assert holds_head_tensors(gguf, head)
    # One byte short of layer 2's last tensor: layer 2 is not held.
    last = max((t for n, t in gguf.tensors.items() if n.startswith("blk.2.")), key=lambda t: t.offset)
    assert held_layers(
        gguf, subtract(follower, [R(last.offset + last.n_bytes - 1, last.offset + last.n_bytes)])
    ) == (1,)
    assert held_layers(gguf, [R(0, gguf.file_size)]) == (0, 1, 2, 3)
    gguf.close()
