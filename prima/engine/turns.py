"""The fair lock a device's generations take turns at its model through: prima.engine.local's
pool holds one, and the decode batcher (prima.engine.batching) runs its batches in its turns."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class TurnTaking:
    """A lock handed out in the order it was asked for. Generations on this device take turns
    through it, one forward pass each (a prompt, or one token), so every running request moves
    on in round-robin order; Python's own lock would let one thread run many steps while others
    starve. Each pass still gets every core."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0  # the ticket the next caller gets
        self._serving = 0  # the ticket whose turn it is

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with self._cv:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._serving += 1
                self._cv.notify_all()
