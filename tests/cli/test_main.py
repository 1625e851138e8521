"""`prima --help` loads neither numba nor grpc (it took 1-2 s), a command's --help not numba."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from prima.cli import main as cli_main
from prima.cli.engine_options import WIRE_DTYPES
from prima.net.codec import WireDType

PROBE = """
import contextlib, json, sys
from prima.cli.main import main
with contextlib.suppress(SystemExit):
    main(sys.argv[1:])
print(json.dumps({m: m in sys.modules for m in ("numba", "grpc")}))
"""


@pytest.mark.parametrize(
    ("argv", "absent"),
    [(["--help"], ["numba", "grpc"]), (["run", "--help"], ["numba"]), (["chat", "--help"], ["numba"])],
)
def test_help_loads_no_compiler(argv: list[str], absent: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert [m for m in absent if loaded[m]] == []


def test_command_table_matches_the_commands() -> None:
    """The help lines listed without importing a command are the ones it registers itself."""
    everything = cli_main.build_parser().format_help()
    listed_only = cli_main.build_parser([]).format_help()
    assert everything == listed_only


def test_wire_dtype_choices_are_the_codecs() -> None:
    assert WIRE_DTYPES == tuple(d.name.lower() for d in WireDType)


@pytest.mark.parametrize(("command", "temp"), [("run", 0.0), ("chat", 0.7), ("serve", 0.7)])
def test_temperature_help_states_the_default_in_use(command: str, temp: float) -> None:
    parser = cli_main.build_parser([command])
    args = parser.parse_args([command, "-p", "x"] if command == "run" else [command])
    assert args.temp == temp
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert f"(default {temp:g})" in sub.format_help()


def test_same_flags_for_the_same_things() -> None:
    """nodes takes the discovery flags run and plan take; profile takes -m like the others."""
    parser = cli_main.build_parser()
    nodes = parser.parse_args(["nodes", "--discover-timeout", "2", "--mdns-interface", "127.0.0.1"])
    assert nodes.timeout == 2.0
    assert nodes.interface == ["127.0.0.1"]
    assert parser.parse_args(["profile", "-m", "x.gguf"]).model == "x.gguf"
