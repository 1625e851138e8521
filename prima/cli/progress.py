"""One line per stage of a slow start (fetching, compiling kernels, starting daemons, planning) on
stderr, so that a first run says what it is doing instead of sitting silent for minutes."""

from __future__ import annotations

import sys


def stage(message: str, prog: str = "prima") -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
