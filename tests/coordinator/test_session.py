"""open_session from SessionOptions: on this device it generates what the engine generates; the
flags that cannot work together are refused before any model is resolved or daemon started;
the options are frozen, read once from the command line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prima.coordinator.session import Progress, SessionOptions, open_session
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.errors import InputError, PlanError
from tests.conftest import tiny_model_path


def _local(**changes: object) -> SessionOptions:
    return dataclasses.replace(
        SessionOptions(model=str(tiny_model_path("tiny-qwen2")), ctx=64, threads=1, local=True), **changes
    )


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _local().ctx = 8  # type: ignore[misc]


def test_mode_follows_exact() -> None:
    assert _local().mode == "q8"
    assert _local(exact=True).mode == "exact"


def test_a_local_session_generates_greedily_and_reports_its_stages() -> None:
    lines: list[str] = []
    session = open_session(_local(exact=True), Progress(stage=lines.append))
    try:
        assert session.ring is None
        assert session.n_ctx == 64
        request = session.request([5, 6, 7], max_tokens=4, sampler=SamplerConfig(temperature=0.0))
        first = session.generate(request)
        again = session.generate(request)
    finally:
        session.close()
    assert first.token_ids == again.token_ids
    assert len(first.token_ids) <= 4
    assert all(isinstance(line, str) for line in lines)


def test_a_lookup_draft_rides_on_every_request() -> None:
    session = open_session(_local(draft=DraftConfig("lookup", 3)))
    try:
        request = session.request([5, 6], max_tokens=1, sampler=SamplerConfig(temperature=0.0))
    finally:
        session.close()
    assert request.draft == DraftConfig("lookup", 3)


def test_a_model_draft_on_this_device_needs_the_draft_file() -> None:
    with pytest.raises(InputError, match="needs the draft's file"):
        open_session(_local(draft=DraftConfig("model")))


def test_a_memory_budget_without_a_local_ring_is_refused() -> None:
    with pytest.raises(InputError, match="--mem-budget sets the budget"):
        open_session(_local(local=False, nodes=("127.0.0.1:1",), mem_budget=1 << 20))


def test_window_count_must_match_the_nodes(tmp_path: Path) -> None:
    """Refused before the model is resolved: the model named here does not exist."""
    options = _local(local=False, model=str(tmp_path / "absent.gguf"), nodes=("a:1", "b:2"), windows=(2,))
    with pytest.raises(InputError, match="1 window sizes for 2 nodes"):
        open_session(options)


def test_windows_that_do_not_cover_the_model_start_no_daemon() -> None:
    """4 layers, windows of 1+1: PlanError before any primad starts."""
    with pytest.raises(PlanError, match="cover 2 layers but the model has 4"):
        open_session(_local(local=False, local_ring=2, windows=(1, 1)))
