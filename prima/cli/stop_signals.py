"""SIGTERM and SIGINT as a graceful stop, for `prima serve` and `primad`: the first asks the
process to stop taking work and finish what is in flight (within --shutdown-timeout); a second
says stop now. Nothing happens in the handler itself but setting events, which the main
thread waits on."""

from __future__ import annotations

import argparse
import signal
import threading
from types import FrameType

from prima.cli.arg_types import non_negative_float

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
WAIT_SLICE_S = 1.0  # the main thread wakes this often, so a signal's handler runs promptly


def add_shutdown_timeout_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help=f"on SIGTERM or Ctrl-C, how long {what} may run on before they are ended with an error "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}; a second signal ends them at once)",
    )


class StopSignals:
    """Installed on the main thread: `requested` is set by the first SIGTERM/SIGINT (`signal`
    names it), `now` by the next."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.now = threading.Event()
        self.signal = ""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.requested.is_set():
            self.now.set()
            return
        self.signal = signal.Signals(signum).name
        self.requested.set()

    def wait(self) -> str:
        """Block until the first signal; its name."""
        while not self.requested.wait(WAIT_SLICE_S):
            pass
        return self.signal
