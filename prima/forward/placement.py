"""Where a node's layers run: a plan gives a node with an accelerator `accel_layers` of each of
its windows for the device, the rest of the window stays on the host CPU.

The accelerator's layers are the first of each window and run as one piece (one compiled model,
one call per micro-batch: what an NPU wants). The host's layers run as one piece too, or one per
layer when the node streams its weights from disk, so that computing one layer overlaps reading
the next (prima.weights.window).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prima.backends.base import KVState


@dataclass(frozen=True)
class Piece:
    """Consecutive layers run by one backend call, on the accelerator or on the host CPU."""

    layers: range
    on_accel: bool


@functools.lru_cache(maxsize=256)
def split_window(window: range, accel_layers: int, *, per_layer: bool = False) -> tuple[Piece, ...]:
    """`window`'s pieces in compute order: its first `accel_layers` layers on the accelerator,
    the rest on the host, as one piece or (`per_layer`, a streaming node) one per layer.
    Remembered: a node asks at every hop of every token, and new objects cost a core just woken
    from idle more than the lookup does."""
    n = max(0, min(accel_layers, len(window)))
    pieces = [Piece(range(window.start, window.start + n), True)] if n else []
    rest = range(window.start + n, window.stop)
    if per_layer:
        pieces += [Piece(range(i, i + 1), False) for i in rest]
    elif rest:
        pieces.append(Piece(rest, False))
    return tuple(pieces)


def host_layers(window: range, accel_layers: int) -> range:
    """The layers of `window` the host CPU computes (whose weights it reads from the mmap)."""
    return range(window.start + max(0, min(accel_layers, len(window))), window.stop)


@dataclass
class SplitKV:
    """A session's KV state on a node whose layers are split: the accelerator's layers in the
    accelerator backend's form (device memory), the host's in the host backend's."""

    n_ctx: int
    accel: KVState | None
    host: KVState | None

    def part(self, piece: Piece) -> KVState:
        """The KV state holding `piece`'s layers."""
        kv = self.accel if piece.on_accel else self.host
        assert kv is not None, f"no KV state for {piece}"
        return kv

    @property
    def n_bytes(self) -> int:
        return sum(kv.n_bytes for kv in (self.accel, self.host) if kv is not None)

    def truncate(self, length: int) -> None:
        for kv in (self.accel, self.host):
            if kv is not None:
                kv.truncate(length)
