"""What a slow start is doing, on stderr: one line per stage (fetching, compiling kernels,
starting daemons, planning), and a tqdm bar for stages that report steps (compiling, profiling,
loading a plan), so that a first run says what it is doing instead of sitting silent for minutes.
Bars draw only on a terminal; piped or logged, the stage lines say it all."""

from __future__ import annotations

import sys
from types import TracebackType

from tqdm import tqdm


def stage(message: str, prog: str = "prima") -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


class StepBar:
    """A progress bar fed by a library's `on_progress(done, total, what)` callback: made at the
    first call (when the total is known), moved to `done`, labelled with the step now."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if self._bar is None:
            # disable=None: draw only when stderr is a terminal.
            self._bar = tqdm(total=total, desc=self.description, unit="step", disable=None, leave=False)
        self._bar.total = total
        self._bar.n = done
        self._bar.set_postfix_str(what, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> StepBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
