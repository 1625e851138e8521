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
