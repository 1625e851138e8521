"""How many threads the next decode step uses, re-chosen from the steps just run.

A thread count timed on a quiet machine is wrong on a laptop in use: once another process keeps
one core busy, a step with two threads waits at every one of its ~100 parallel launches for the
thread that shares that core, and decode slows threefold or more, while one thread (which gets
the free core to itself) keeps its quiet speed. Load comes and goes while a daemon runs, so the
choice cannot be made once at start (prima.engine.thread_tuning still picks the wait policy and
the cores there, which libgomp reads only once).

DecodeThreads is pure bookkeeping over step times the caller measures: it keeps the count in
use, now and then runs a few steps with each other count (a probe), and moves to one that is
clearly faster. Probes come soon after start or a switch and then ever more rarely while the
choice keeps winning; steps of the count in use that turn slower (another process took a core)
bring the next probe forward. A count whose probe step is twice as slow as the count in use is
dropped from that probe at once: on a busy machine a step with too many threads can take many
times a normal one, and the probe must not cost more than it can win.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections import deque

# The environment switch that keeps the thread count fixed at --threads (benchmarks that time a
# given count, prima.engine.thread_tuning's measuring runs).
FIXED_ENV = "PRIMA_DECODE_THREADS"
PROBE_STEPS = 4  # steps a probe runs each other count; its first is dropped (a switch's warm-up)
FIRST_INTERVAL = 16  # steps before the first probe, and after a switch or a change of load
LONGEST_INTERVAL = 512  # steps between probes at most, while the choice keeps winning ...
LONGEST_GAP_S = 3.0  # ... and seconds of decode between probes at most
MARGIN = 0.10  # another count must be this much faster to take over (noise is not a reason)
LOAD_CHANGE = 1.5  # a step median this many times the last decision's means the load rose
HOPELESS = 2.0  # a probe step this many times the count in use ends that count's probe


def adaptive_by_default() -> bool:
    """Whether decode threads adapt (the default), or stay at --threads (PRIMA_DECODE_THREADS=fixed)."""
    return os.environ.get(FIXED_ENV, "").strip().lower() != "fixed"


def thread_options(most: int) -> tuple[int, ...]:
    """The counts worth trying, most first: all threads, half of them, one."""
    return tuple(sorted({max(1, most), max(1, most // 2), 1}, reverse=True))


class DecodeThreads:
    """The thread count for one window's decode steps (see the module docstring). Callers ask
    `next_threads()` before a step and `record()` its time after; thread-safe."""

    def __init__(self, most: int) -> None:
        self.options = thread_options(most)
        self.current = self.options[0]
        self.switches = 0
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=PROBE_STEPS)  # ms of the count in use
        self._probe: list[int] = []  # counts still to run in the probe under way
        self._probed: dict[int, list[float]] = {}
        self._interval = FIRST_INTERVAL
        self._steps_left = FIRST_INTERVAL
        self._gap_ms = 0.0  # decode time since the last probe
        self._reference_ms: float | None = None  # the count in use's median at the last decision

    def next_threads(self) -> int:
        with self._lock:
            return self._probe[0] if self._probe else self.current

    def record(self, threads: int, ms: float) -> None:
        """One decode step with `threads` threads took `ms`."""
        with self._lock:
            if self._probe and threads == self._probe[0]:
                self._probe.pop(0)
                self._probed.setdefault(threads, []).append(ms)
                if self._recent and ms > HOPELESS * statistics.median(self._recent):
                    self._probe = [n for n in self._probe if n != threads]
                if not self._probe:
                    self._decide()
                return
            if threads != self.current:
                return  # a step begun before a switch: it says nothing about either count
            self._recent.append(ms)
            self._steps_left -= 1
            self._gap_ms += ms
            if self._load_rose():
                self._steps_left = 0
            if len(self._recent) == PROBE_STEPS and (
                self._steps_left <= 0 or self._gap_ms >= LONGEST_GAP_S * 1000.0
            ):
                others = [n for n in self.options if n != self.current]
                self._probe = [n for n in others for _ in range(PROBE_STEPS)]
                self._probed = {}

    def _load_rose(self) -> bool:
        """The count in use turned slower since the last decision (a change for the faster
        needs no early probe: the count in use gained too, and the periodic probes find the rest)."""
        if self._reference_ms is None or len(self._recent) < PROBE_STEPS:
            return False
        rose = statistics.median(self._recent) > self._reference_ms * LOAD_CHANGE
        if rose:
            self._reference_ms = None  # one early probe per change, not one per step
        return rose

    def _decide(self) -> None:
        """End of a probe: keep the count in use unless another was clearly faster."""
        mine = statistics.median(self._recent)
        theirs = {n: statistics.median(ms[1:] or ms) for n, ms in self._probed.items()}
        best = min(theirs, key=theirs.__getitem__)
        if theirs[best] < mine * (1 - MARGIN):
            self.current = best
            self.switches += 1
            self._recent = deque(self._probed[best][1:], maxlen=PROBE_STEPS)
            self._reference_ms = theirs[best]
            self._interval = FIRST_INTERVAL
        else:
            self._reference_ms = mine
            self._interval = min(self._interval * 2, LONGEST_INTERVAL)
        self._steps_left = self._interval
        self._gap_ms = 0.0
