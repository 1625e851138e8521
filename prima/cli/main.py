"""`prima`: the coordinator command line. Each subcommand lives in its own module under
`prima.cli` and exposes `register(subparsers)`; this file only wires them together and maps
PrimaError to a clean message and exit code."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from importlib import import_module

# First prima import: sets the thread-pool environment before numpy or numba load.
import prima.kernels.thread_env  # noqa: F401
from prima.errors import PrimaError

# One module per subcommand; each defines register(subparsers) -> None and sets `func`.
COMMAND_MODULES = [
    "prima.cli.cmd_run",
    "prima.cli.cmd_chat",
    "prima.cli.cmd_serve",
    "prima.cli.cmd_models",
    "prima.cli.cmd_tokenize",
    "prima.cli.cmd_plan",
    "prima.cli.cmd_profile",
    "prima.cli.cmd_nodes",
    "prima.cli.cmd_ring",
    "prima.cli.cmd_bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prima", description="Run LLMs across a ring of home devices.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # SIGTERM (systemd, kill, a closing terminal's session) unwinds like Ctrl-C, so that the
    # daemons a command started are stopped and their advertisements withdrawn.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(args.func(args) or 0)
    except PrimaError as exc:
        print(f"prima: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nprima: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        return 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived: unwind (closing sessions and rings) and exit."""


def _terminated(signum: int, frame: object) -> None:
    del signum, frame
    raise Terminated


if __name__ == "__main__":
    sys.exit(main())
