"""`prima plan` sizes the KV cache for the context `prima run` uses, unless told otherwise, and
counts a draft model (-md) in the head's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prima.cli import cmd_plan
from prima.cli.engine_options import DEFAULT_CTX
from prima.cli.main import main
from prima.model.gguf_file import GGUFFile
from prima.scheduler.profile import DeviceProfile, devices_to_json, draft_resident_bytes


def test_plan_sizes_for_the_context_run_uses(smollm2_path: Path) -> None:
    assert cmd_plan._model_profile(str(smollm2_path), None, None).ctx_tokens == DEFAULT_CTX  # noqa: SLF001
    assert cmd_plan._model_profile(str(smollm2_path), None, 512).ctx_tokens == 512  # noqa: SLF001


def test_plan_with_a_draft_model_shows_it_in_the_heads_memory(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One roomy device (it holds every layer either way): with -md its RAM need grows by the
    draft's whole file and KV cache, and the text output names the draft's share."""
    devices = tmp_path / "devices.json"
    device = DeviceProfile(
        "solo", ram_available_bytes=8 << 30, mem_bandwidth_bytes_per_s=2e10, cpu_flops={"F32": 1e10}
    )
    devices.write_text(devices_to_json([device]))
    base = ["plan", "--devices", str(devices), "-m", str(smollm2_path), "--ctx", "512", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "-md", str(smollm2_path)]) == 0
    drafting = json.loads(capsys.readouterr().out)
    with GGUFFile(smollm2_path) as gguf:
        draft_bytes = draft_resident_bytes(gguf, 512)
    assert plain["draft_bytes"] == 0
    assert drafting["draft_bytes"] == draft_bytes
    grown = drafting["nodes"][0]["ram_needed_bytes"] - plain["nodes"][0]["ram_needed_bytes"]
    assert grown == draft_bytes
    assert main(base[:-1] + ["-md", str(smollm2_path)]) == 0
    assert (
        f"the head solo also holds a draft model: {draft_bytes / (1 << 20):.0f} MiB"
        in capsys.readouterr().out
    )
