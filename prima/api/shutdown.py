"""`prima serve`'s graceful stop: refuse new requests (503), let the generations in flight finish
within a deadline, end the rest with an in-band error event and `[DONE]`, and say how many of
each there were.

The HTTP handlers count themselves in and out of `InFlight`; `drain` waits on it. Nothing here
touches sockets or signals: the CLI gets the signal and calls `drain`, the handlers answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

WIND_UP_S = 10.0  # after the cut: how long the handlers get to write the error event and [DONE]


@dataclass(frozen=True)
class StopReport:
    """The requests in flight when the stop began, and how they ended."""

    in_flight: int
    finished: int
    cut: int


class InFlight:
    """The generation and embedding requests being answered now (counted from when their body
    is read to when their answer is written), and, once a stop has begun, how they ended."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._stopping = False
        self._at_stop = 0
        self._cut = 0

    @property
    def active(self) -> int:
        return self._active

    def begin_stop(self) -> int:
        """The stop begins now (a second call changes nothing); the requests in flight then."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self._at_stop = self._active
            return self._at_stop

    @contextmanager
    def track(self) -> Iterator[None]:
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def mark_cut(self) -> None:
        """A request in flight was ended by the stop without its whole answer: cut at the
        deadline, or refused while it queued (its handler still counts itself out)."""
        with self._cond:
            self._cut += 1

    def wait_idle(self, timeout_s: float, now: threading.Event | None = None) -> bool:
        """Wait until no request is in flight, for at most `timeout_s`, or until `now` is set;
        whether none is."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._active:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (now is not None and now.is_set()):
                    return False
                self._cond.wait(min(remaining, 0.1))
            return True

    def report(self) -> StopReport:
        with self._cond:
            cut = min(self._cut, self._at_stop)
            return StopReport(in_flight=self._at_stop, finished=self._at_stop - cut, cut=cut)


class Stoppable(Protocol):
    """The parts of the API server a stop drives."""

    in_flight: InFlight

    def stop_taking_work(self) -> int: ...

    def cut_generations(self) -> None: ...


def drain(server: Stoppable, timeout_s: float, now: threading.Event | None = None) -> StopReport:
    """Refuse new requests, wait up to `timeout_s` (or until `now` is set: a second signal)
    for those in flight, then end the rest at their next token and give their handlers
    WIND_UP_S to write the error event and `[DONE]`."""
    server.stop_taking_work()
    if not server.in_flight.wait_idle(timeout_s, now):
        server.cut_generations()
        server.in_flight.wait_idle(WIND_UP_S)
    return server.in_flight.report()
