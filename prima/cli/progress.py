"""What a slow start is doing, on stderr: one line per stage (fetching, compiling kernels,
starting daemons, planning), and a tqdm bar for stages that report steps (compiling, profiling,
loading a plan), so that a first run says what it is doing instead of sitting silent for minutes.
Bars draw only on a terminal; piped or logged, the stage lines say it all. A bar ends before any
stage line is printed (and a step bar when its last step is done), so a line never lands on the
end of a bar."""

from __future__ import annotations

import sys
import weakref
from types import TracebackType
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:  # the ring's types: a run on one device loads no gRPC
    from prima.coordinator.readiness import RingFetch


# The bars drawing now: a stage line ends them first (a later report starts a new bar).
_open_bars: weakref.WeakSet[FetchBar | StepBar] = weakref.WeakSet()


def stage(message: str, prog: str = "prima") -> None:
    for bar in list(_open_bars):
        bar.close()
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


class FetchBar:
    """A tqdm bar on stderr of the bytes a ring's nodes fetch before they take a plan on (the
    coordinator's on_fetch); it opens at the first report, so a ring that fetches nothing
    shows nothing."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None

    def __call__(self, fetch: RingFetch) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=fetch.needed_bytes,
                unit="B",
                unit_scale=True,
                desc="prima: nodes fetching",
                file=sys.stderr,
                disable=None,  # draw only when stderr is a terminal
            )
            _open_bars.add(self)
        self._bar.total = fetch.needed_bytes
        self._bar.n = fetch.held_bytes
        names = ", ".join(f"{n} from {p.source or '?'}" for n, p in fetch.nodes)
        self._bar.set_postfix_str(f"{names}; ready in ~{fetch.eta_s:.0f} s", refresh=True)

    def close(self) -> None:
        _open_bars.discard(self)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> FetchBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class StepBar:
    """A progress bar fed by a library's `on_progress(done, total, what)` callback: made at the
    first call (when the total is known), moved to `done`, labelled with the step now."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if self._bar is None:
            # disable=None: draw only when stderr is a terminal.
            self._bar = tqdm(
                total=total, desc=self.description, unit="step", disable=None, leave=False, file=sys.stderr
            )
            _open_bars.add(self)
        self._bar.total = total
        self._bar.n = done
        self._bar.set_postfix_str(what, refresh=False)
        self._bar.refresh()
        if done >= total:  # the last step: whatever is printed next starts on a line of its own
            self.close()

    def close(self) -> None:
        _open_bars.discard(self)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> StepBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
