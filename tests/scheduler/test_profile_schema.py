"""Profiles: JSON round trips, validation of untrusted files, and deriving a model profile."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from prima.errors import InputError
from prima.model.gguf_file import GGUFFile
from prima.scheduler.profile_schema import (
    AcceleratorProfile,
    DeviceProfile,
    ModelProfile,
    devices_to_json,
    load_cluster_file,
)


def test_profile_device_round_trips_through_json(make_device):
    npu = AcceleratorProfile("cann", 3 << 30, {"F16": 4e12}, 50e9, shares_ram=True)
    for dev in (make_device("phone"), make_device("pi", accel=npu), make_device("local", net_mbps=0)):
        raw = json.loads(json.dumps(dev.to_dict()))
        assert DeviceProfile.from_dict(raw) == dev
    assert make_device("local", net_mbps=0).to_dict()["net_bandwidth_bytes_per_s"] is None


def test_profile_device_round_trips_what_it_holds(make_device):
    """A node that fetched only some layers: which, how much, and its disk budget survive JSON;
    a profile without them (an older file) holds the whole model and has no disk cap."""
    dev = dataclasses.replace(
        make_device("pi"),
        held_layers=(0, 1, 5),
        holds_head_tensors=False,
        held_bytes=3 << 30,
        disk_budget_bytes=20 << 30,
    )
    assert DeviceProfile.from_dict(json.loads(json.dumps(dev.to_dict()))) == dev
    raw = make_device("old").to_dict()
    for key in ("held_layers", "holds_head_tensors", "held_bytes", "disk_budget_bytes"):
        del raw[key]
    old = DeviceProfile.from_dict(raw)
    assert old.held_layers is None
    assert old.holds_layer(79)
    assert (old.disk_budget_bytes, old.holds_head_tensors) == (0, True)


def test_profile_model_round_trips_through_json(make_model):
    model = make_model()
    assert ModelProfile.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_profile_cluster_file_round_trips(tmp_path, make_device, make_model):
    devices = [make_device("a"), make_device("b")]
    path = tmp_path / "devices.json"
    path.write_text(devices_to_json(devices, make_model()))
    assert load_cluster_file(path) == (devices, make_model())
    path.write_text(json.dumps([d.to_dict() for d in devices]))
    assert load_cluster_file(path) == (devices, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema_version": 99}, "schema_version 99"),
        ({"ram_available_bytes": -1}, "ram_available_bytes"),
        ({"ram_available_bytes": "lots"}, "ram_available_bytes"),
        ({"os": "plan9"}, "os must be one of"),
        ({"cpu_flops": {"F32": "fast"}}, "cpu_flops"),
        ({"kind": "model"}, "kind"),
        ({"held_layers": [0, -1]}, "held_layers must be a list of layer indices"),
        ({"held_layers": "all"}, "held_layers must be a list of layer indices"),
        ({"holds_head_tensors": 1}, "holds_head_tensors must be true or false"),
        ({"disk_budget_bytes": -5}, "disk_budget_bytes"),
    ],
)
def test_profile_rejects_bad_device_fields(make_device, change, message):
    raw = {**make_device("a").to_dict(), **change}
    with pytest.raises(InputError, match=message):
        DeviceProfile.from_dict(raw)


def test_profile_names_a_missing_field(make_device):
    raw = make_device("a").to_dict()
    del raw["mem_bandwidth_bytes_per_s"]
    with pytest.raises(InputError, match="missing field 'mem_bandwidth_bytes_per_s'"):
        DeviceProfile.from_dict(raw)


def test_profile_cluster_file_errors_say_what_to_do(tmp_path):
    path = tmp_path / "devices.json"
    with pytest.raises(InputError, match="cannot read"):
        load_cluster_file(path)
    path.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_cluster_file(path)
    path.write_text('{"devices": []}')
    with pytest.raises(InputError, match="at least one device"):
        load_cluster_file(path)


def test_profile_model_from_gguf_derives_sizes(tmp_path, write_tiny_gguf):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    with GGUFFile(path) as f:
        m = ModelProfile.from_gguf(f, ctx_tokens=1024)
    assert m.n_layers == 2
    # f32 norm (8) + f32 q (64) + f16 k (32) + f32 up (128) per layer.
    assert m.layer_bytes == 8 * 4 + 64 * 4 + 32 * 2 + 128 * 4
    assert m.layer_flops == {"F32": 2.0 * (8 + 64 + 128), "F16": 2.0 * 32}
    # 1 KV head x (4 + 4) f32 values per token per layer (exact mode's cache; q8's takes half).
    assert m.kv_bytes_per_token_per_layer == 1 * 8 * 4
    assert m.input_bytes == 16 * 8 * 4
    assert m.output_bytes == 16 * 8 * 2 + 8 * 4
    assert m.output_flops == {"F16": 2.0 * 16 * 8}
    assert m.activation_bytes == 8 * 4
    assert m.ctx_tokens == 256  # clipped to the model's context length


def test_profile_model_from_gguf_with_tied_output(tmp_path, write_tiny_gguf):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    with GGUFFile(path) as f:
        m = ModelProfile.from_gguf(f)
    assert m.output_bytes == 8 * 4  # only output_norm: the head reuses token_embd
    assert m.output_flops == {"F32": 2.0 * 16 * 8}


def test_profile_model_from_real_gguf(smollm2_path: Path) -> None:
    with GGUFFile(smollm2_path) as f:
        m = ModelProfile.from_gguf(f)
    assert m.n_layers == 30
    assert set(m.layer_flops) >= {"Q4_1"}
    # SmolLM2-135M: 3 KV heads of 64 -> K and V of 192 floats each.
    assert m.kv_bytes_per_token_per_layer == 3 * 128 * 4
    assert m.activation_bytes == 576 * 4
    assert 0 < m.layer_bytes * m.n_layers < smollm2_path.stat().st_size
    assert math.isfinite(m.output_flops[next(iter(m.output_flops))])
