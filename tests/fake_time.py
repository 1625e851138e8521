"""An injected clock for code that times itself (probes, benches): tests check what is computed
from the time, never how long anything took."""

from __future__ import annotations

from collections.abc import Sequence


class FakeTime:
    """A stand-in for a probe's `time` module: `perf_counter` moves only by the next of
    `steps_s` per reading (the last repeats) and by what `advance` adds, so a probe's timed
    interval is whatever the test says it is."""

    def __init__(self, steps_s: float | Sequence[float] = 0.0) -> None:
        self.steps_s = [steps_s] if isinstance(steps_s, (int, float)) else list(steps_s)
        self.now = 1000.0
        self.readings = 0

    def perf_counter(self) -> float:
        self.now += self.steps_s[min(self.readings, len(self.steps_s) - 1)]
        self.readings += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A probe's idle time passes at once, and its readings do not move."""
        self.now += seconds
