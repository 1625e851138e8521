"""Placement flags: bad --nodes or --local-ring values are errors, never a silent local run."""

from __future__ import annotations

import argparse

import pytest

from prima.cli.engine_options import add_model_args, open_session
from prima.errors import InputError


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
