"""How a node's windows split between its accelerator and its host CPU (prima.forward.placement)."""

from __future__ import annotations

import pytest

from prima.forward.placement import Piece, SplitKV, host_layers, split_window


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("accel", [0, 1, 3, 5, 9])
def test_pieces_tile_the_window_in_order(accel: int, per_layer: bool) -> None:
    window = range(10, 15)
    pieces = split_window(window, accel, per_layer=per_layer)
    assert [i for p in pieces for i in p.layers] == list(window)
    on_accel = [i for p in pieces if p.on_accel for i in p.layers]
    assert on_accel == list(window)[: min(accel, len(window))]
    assert sum(p.on_accel for p in pieces) <= 1  # the accelerator's part is one call
    assert [i for i in window if i not in on_accel] == list(host_layers(window, accel))
    host = [p for p in pieces if not p.on_accel]
    if per_layer:
        assert all(len(p.layers) == 1 for p in host)
    else:
        assert len(host) <= 1


class _KV:
    def __init__(self, n_bytes: int) -> None:
        self.n_ctx = 8
        self.n_bytes = n_bytes
        self.length = 8

    def truncate(self, length: int) -> None:
        self.length = length


def test_split_kv_routes_pieces_and_truncates_both() -> None:
    accel, host = _KV(100), _KV(20)
    kv = SplitKV(8, accel, host)
    assert kv.part(Piece(range(0, 2), True)) is accel
    assert kv.part(Piece(range(2, 3), False)) is host
    assert kv.n_bytes == 120
    kv.truncate(3)
    assert (accel.length, host.length) == (3, 3)
    assert SplitKV(8, None, host).n_bytes == 20
