"""Placement flags: bad --nodes or --local-ring values are errors, never a silent local run
(tests/cli/test_flags_before_load.py checks they are refused before any model is resolved)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from prima.cli.engine_options import add_model_args, open_session, session_options
from prima.engine.speculative import DEFAULT_DRAFT_MAX, RING_DRAFT_MAX, DraftConfig
from prima.errors import InputError, PlanError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--nodes", "bad"), "argument --nodes: expected host:port"),
        (("--nodes", "127.0.0.1:x"), "argument --nodes: expected host:port"),
        (("--nodes", "127.0.0.1:70000"), "argument --nodes: .*port 1..65535"),
        (("--nodes", ","), "argument --nodes: expected host:port"),
        (("--local-ring", "0"), "argument --local-ring: must be at least 1"),
    ],
)
def test_bad_placement_is_a_usage_error(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)
    assert re.search(message, capsys.readouterr().err)


def test_nodes_parse_to_addresses_in_ring_order() -> None:
    assert _args("--nodes", "b:2, a:1,[::1]:7070").nodes == ["b:2", "a:1", "[::1]:7070"]


def test_window_count_must_match_the_local_ring(smollm2_path: Path) -> None:
    """Two windows for three daemons: refused before the model is even resolved."""
    with pytest.raises(InputError, match="2 window sizes for 3 nodes"):
        open_session(_args("-m", str(smollm2_path), "--local-ring", "3", "--windows", "5,5"))


def test_windows_that_do_not_fit_the_model_fail_before_any_daemon_starts(smollm2_path: Path) -> None:
    """15 of SmolLM2's 30 layers: refused while nothing has been started (this returns in well
    under a daemon's start-up, and no primad is left behind)."""
    with pytest.raises(PlanError, match="cover 15 layers but the model has 30"):
        open_session(_args("-m", str(smollm2_path), "--local-ring", "3", "--windows", "5,5,5"))


def test_zero_threads_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("-t", "0")
    assert "must be at least 1" in capsys.readouterr().err


def test_the_flags_are_read_once_into_frozen_options() -> None:
    args = _args(
        "-m", "some-model", "--nodes", "a:1,b:2", "--windows", "3,4", "--exact", "--draft", "lookup",
        "--draft-max", "5", "--mdns-interface", "127.0.0.1", "--expect", "2", "--wire-dtype", "f16",
    )  # fmt: skip
    options = session_options(args, parallel=3)
    assert options.model == "some-model"
    assert options.nodes == ("a:1", "b:2")
    assert options.windows == (3, 4)
    assert options.mode == "exact"
    assert options.draft == DraftConfig("lookup", 5)
    assert options.parallel == 3
    assert options.wire_dtype == "f16"
    assert options.discovery.interfaces == ("127.0.0.1",)
    assert options.discovery.expect == 2
    assert not options.local


def test_drafts_are_longer_by_default_on_a_ring() -> None:
    """Kept drafts share a trip round a ring, so a ring drafts more tokens a pass unless told."""
    assert session_options(_args("--draft", "lookup", "--local")).draft.max_tokens == DEFAULT_DRAFT_MAX
    assert (
        session_options(_args("--draft", "lookup", "--nodes", "a:1,b:2")).draft.max_tokens == RING_DRAFT_MAX
    )
    assert session_options(_args("--draft", "lookup", "--local", "--draft-max", "2")).draft.max_tokens == 2


def test_a_draft_model_file_means_drafting_with_a_model() -> None:
    options = session_options(_args("--draft-model", "small.gguf"))
    assert options.draft.method == "model"
    assert options.draft_model == "small.gguf"


def test_a_draft_model_file_with_lookup_drafting_is_refused() -> None:
    with pytest.raises(InputError, match="drop one of them"):
        session_options(_args("--draft-model", "small.gguf", "--draft", "lookup"))
