"""`prima plan` sizes the KV cache for the context `prima run` uses, unless told otherwise."""

from __future__ import annotations

from pathlib import Path

from prima.cli import cmd_plan
from prima.cli.engine_options import DEFAULT_CTX


def test_plan_sizes_for_the_context_run_uses(smollm2_path: Path) -> None:
    assert cmd_plan._model_profile(str(smollm2_path), None, None).ctx_tokens == DEFAULT_CTX  # noqa: SLF001
    assert cmd_plan._model_profile(str(smollm2_path), None, 512).ctx_tokens == 512  # noqa: SLF001
