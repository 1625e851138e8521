"""`prima`: the coordinator command line. Each subcommand lives in its own module under
`prima.cli` and exposes `register(subparsers)`; this file only wires them together and maps
PrimaError to a clean message and exit code."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib import import_module

# First prima import: hashing and thread pools set up before the rest loads (prima.startup).
import prima.startup  # noqa: F401
from prima.errors import PrimaError

# One module per subcommand; each defines register(subparsers) -> None and sets `func`. The help
# line is here too, so that `prima --help` lists the commands without importing them (and numba,
# grpc, ... with them); only the command being run is imported.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("prima.cli.cmd_run", "generate text for a prompt"),
    "chat": ("prima.cli.cmd_chat", "chat with a model in the terminal"),
    "serve": ("prima.cli.cmd_serve", "serve an OpenAI-compatible HTTP API"),
    "top": ("prima.cli.cmd_top", "show the cluster a running `prima serve` runs on"),
    "models": ("prima.cli.cmd_models", "list known models or download one"),
    "tokenize": ("prima.cli.cmd_tokenize", "print the token ids of some text"),
    "plan": (
        "prima.cli.cmd_plan",
        "plan a model over the running daemons (discovered or --nodes) or a devices file",
    ),
    "profile": ("prima.cli.cmd_profile", "measure this device's memory, disk and compute"),
    "nodes": ("prima.cli.cmd_nodes", "list the primad daemons found on the LAN over mDNS"),
    "ring": ("prima.cli.cmd_ring", "start a local ring of primad daemons, or inspect running ones"),
    "cluster": ("prima.cli.cmd_cluster", "create the cluster's credentials and add devices to it"),
    "tune": ("prima.cli.cmd_tune", "choose compute threads by timing a decode step here"),
    "warmup": ("prima.cli.cmd_warmup", "fetch a model and compile the kernels for this CPU, then exit"),
    "bench": ("prima.cli.cmd_bench", "measure prima (and llama.cpp, if installed) on a model"),
    "npu": ("prima.cli.cmd_npu", "compile a model's windows for an Ascend NPU (CANN ATC)"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every command listed and, when `argv` names one (None: all of them),
    that command's own arguments registered."""
    parser = argparse.ArgumentParser(prog="prima", description="Run LLMs across a ring of home devices.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = set(COMMANDS) if argv is None else set(argv) & set(COMMANDS)
    for name, (module, help_line) in COMMANDS.items():
        if name in wanted:
            import_module(module).register(sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs a refused TLS handshake itself ("Handshake failed with error
    # SSL_ERROR_SSL ...") before prima's own message says what it means and what to do; only its
    # errors are shown. It reads this when grpc is imported, which no command has done yet.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser([a for a in argv if not a.startswith("-")][:1])  # only -v comes before it
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
