"""A generator run in a thread of its own, so that its consumer's waits are not its waits.

A head's Generate handler yields each token to gRPC, and gRPC returns only once the token has
been written to the coordinator's connection. Run in the handler thread, the generation would
wait for that write (half a millisecond on a loaded machine) before it starts the next token's
trip round the ring; run ahead, it starts at once and the write overlaps the trip.

Overlap needs timing too: both threads need the interpreter lock, so a consumer woken by a new
token would compete with the generation starting the next one. Items are therefore handed over
when the source is about to wait (it calls `waiting()`, as the head does before it waits for the
ring), and at the latest when the source makes its next item or ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from typing import Generic, TypeVar

T = TypeVar("T")


class _End:
    pass


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


WAITING = object()  # what `next` returns when nothing arrived within its timeout
_running = threading.local()  # .ahead: the RunAhead whose source runs in this thread


def waiting() -> None:
    """The calling thread is about to wait: if it runs a RunAhead's source, hand over the items
    that source has made so far. Anywhere else this does nothing."""
    ahead: RunAhead[object] | None = getattr(_running, "ahead", None)
    if ahead is not None:
        ahead._hand_over()


def stop_requested() -> bool:
    """Whether the calling thread runs a RunAhead's source whose consumer asked it to stop: a
    source in a long stretch without items (a head prefilling a long prompt) checks this to end
    early instead of at its next item. Anywhere else, False."""
    ahead: RunAhead[object] | None = getattr(_running, "ahead", None)
    return ahead is not None and ahead._stop.is_set()


class RunAhead(Generic[T]):
    """Iterate `source` in a thread that hands every item over to `next` (when the source waits,
    makes its next item or ends: see the module's docstring). The source runs until it
    ends, fails (its exception is raised by `next` in turn) or is stopped; `stop` takes effect
    at the source's next item, where the thread closes it. `on_end` runs in that thread once
    the source is closed, whichever way it ended, before `next` reports the end."""

    def __init__(
        self,
        source: Generator[T, None, None],
        name: str = "run-ahead",
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._source = source
        self._on_end = on_end
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._held: list[object] = []  # made by the source, not yet handed over
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _running.ahead = self
        last: object = _End()
        try:
            for item in self._source:
                self._hand_over()
                if self._stop.is_set():
                    break
                self._held.append(item)
        except BaseException as exc:  # raised again in the consumer's thread
            last = _Failed(exc)
        finally:
            _running.ahead = None
            # The consumer learns of the end only after on_end: whatever on_end releases (a
            # caller's Generate slot) is free by the time the caller hears the stream end.
            try:
                self._source.close()
            finally:
                if self._on_end is not None:
                    self._on_end()
                self._held.append(last)
                self._hand_over()

    def _hand_over(self) -> None:
        """Queue the held items for the consumer (only ever called in the source's thread)."""
        for item in self._held:
            self._items.put(item)
        self._held.clear()

    def next(self, timeout_s: float | None = None) -> T | None | object:
        """The next item; None once the source has ended; WAITING if `timeout_s` passed first.
        An exception of the source is raised here."""
        if self._finished:
            return None
        try:
            item = self._items.get(timeout=timeout_s)
        except queue.Empty:
            return WAITING
        if isinstance(item, _End):
            self._finished = True
            return None
        if isinstance(item, _Failed):
            self._finished = True
            raise item.exc
        return item  # type: ignore[return-value]

    def stop(self) -> None:
        """Ask the source to stop at its next item (returns at once)."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the thread to end; whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
