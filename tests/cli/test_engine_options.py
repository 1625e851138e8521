"""Placement flags: bad --nodes or --local-ring values are errors, never a silent local run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prima.cli.engine_options import add_model_args, open_session
from prima.errors import InputError, PlanError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--nodes", "bad"), "--nodes takes host:port"),
        (("--nodes", "127.0.0.1:x"), "--nodes takes host:port"),
        (("--local-ring", "0"), "--local-ring needs at least 1"),
    ],
)
def test_bad_placement_is_an_input_error(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(InputError, match=message):
        open_session(_args(*argv))


def test_windows_that_do_not_fit_the_local_ring_fail_before_any_daemon_starts(smollm2_path: Path) -> None:
    """Two windows for three daemons: refused while nothing has been started (this returns in
    well under a daemon's start-up, and no primad is left behind)."""
    with pytest.raises(PlanError, match="3 nodes but 2 window sizes"):
        open_session(_args("-m", str(smollm2_path), "--local-ring", "3", "--windows", "5,5"))


def test_zero_threads_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("-t", "0")
    assert "must be at least 1" in capsys.readouterr().err
