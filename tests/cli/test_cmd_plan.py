"""`prima plan` end to end: it prints the table and the drops, sizes the KV cache for the context
`prima run` uses unless told otherwise, and counts a draft model (-md) in the head's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prima.cli import cmd_plan
from prima.cli.engine_options import DEFAULT_CTX
from prima.cli.main import main
from prima.model.gguf_file import GGUFFile
from prima.scheduler.profile_schema import DeviceProfile, devices_to_json, draft_resident_bytes
from tests.scheduler.conftest import make_device, make_model


def test_plan_sizes_for_the_context_run_uses(smollm2_path: Path) -> None:
    assert cmd_plan._model_profile(str(smollm2_path), None, None).ctx_tokens == DEFAULT_CTX
    assert cmd_plan._model_profile(str(smollm2_path), None, 512).ctx_tokens == 512


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


def test_cmd_plan_prints_the_table_and_the_drops(tmp_path, capsys):
    path = tmp_path / "devices.json"
    devices = [
        make_device("head", ram_gib=1.6),
        make_device("fast", ram_gib=1.6),
        make_device("far", latency_ms=400.0),
    ]
    path.write_text(devices_to_json(devices, make_model(n_layers=12)))
    assert main(["plan", "--devices", str(path)]) == 0
    out = capsys.readouterr().out
    assert "12 layers" in out
    assert "head" in out
    assert "dropped far: faster without it" in out


def test_cmd_plan_json_with_a_model_profile_file(tmp_path, capsys):
    devices_path = tmp_path / "devices.json"
    devices_path.write_text(devices_to_json([make_device("a", ram_gib=0.9), make_device("b", ram_gib=2.0)]))
    model_path = tmp_path / "model.json"
    model_path.write_text(json.dumps(make_model(n_layers=8).to_dict()))
    assert main(["plan", "--devices", str(devices_path), "-m", str(model_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_layers"] == 8
    assert sum(n["layers"] for n in doc["nodes"]) == 8
    assert doc["predicted_ms_per_token"] > 0


def test_cmd_plan_reports_a_bad_devices_file(tmp_path, capsys):
    path = tmp_path / "devices.json"
    path.write_text('{"devices": [{"node_id": "a"}]}')
    assert main(["plan", "--devices", str(path)]) == 1
    assert "missing field" in capsys.readouterr().err


def test_cmd_plan_shows_what_a_streaming_device_pins_and_rereads(tmp_path, capsys):
    """The scenario of test_halda's streaming case: 'tiny' holds 2 of its layers and streams the rest."""
    path = tmp_path / "devices.json"
    devices = [
        make_device("home", ram_gib=1.8, disk_gbps=0.0),
        make_device("tiny", ram_gib=0.6, disk_gbps=3.0),
    ]
    model = make_model(n_layers=12, layer_mib=200, kv_mib=2)
    path.write_text(devices_to_json(devices, model))
    assert main(["plan", "--devices", str(path), "--json"]) == 0
    rows = {r["node_id"]: r for r in json.loads(capsys.readouterr().out)["nodes"]}
    home, tiny = rows["home"], rows["tiny"]
    assert not home["streams"]
    assert home["reread_bytes_per_token"] == 0
    assert tiny["streams"]
    assert 0 <= tiny["pinned_layers"] < tiny["layers"]
    assert tiny["reread_bytes_per_token"] == (tiny["layers"] - tiny["pinned_layers"]) * model.layer_bytes
    assert tiny["ram_needed_bytes"] <= tiny["ram_budget_bytes"]
    assert main(["plan", "--devices", str(path)]) == 0
    assert "READ/TOK" in capsys.readouterr().out
