"""A draft model on the head leaves it less memory for layers: its whole file and its KV cache
count with the head's fixed bytes, and Halda moves layers off the head to make room."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from prima.model.gguf_file import GGUFFile
from prima.scheduler import halda
from prima.scheduler.profile_schema import KV_ELEMENT_BYTES, DeviceProfile, ModelProfile, draft_resident_bytes

from .conftest import GiB, MiB


def test_draft_resident_bytes_are_its_whole_file_and_a_kv_cache(
    tmp_path: Path, write_tiny_gguf: Callable[..., None]
) -> None:
    path = tmp_path / "draft.gguf"
    write_tiny_gguf(path, tied=False)
    # As written: token_embd 16x8 f32; per layer a norm (8 f32), q 8x8 f32, k 4x8 f16, up 16x8
    # f32; output_norm 8 f32; output 16x8 f16.
    weights = 16 * 8 * 4 + 2 * (8 * 4 + 8 * 8 * 4 + 4 * 8 * 2 + 16 * 8 * 4) + 8 * 4 + 16 * 8 * 2
    kv_per_token = 2 * 1 * (4 + 4) * KV_ELEMENT_BYTES  # 2 layers, 1 KV head, K and V of 4
    with GGUFFile(path) as gguf:
        assert draft_resident_bytes(gguf, 100) == weights + 100 * kv_per_token
        # Its context is 256 tokens: a longer one is not allocated.
        assert draft_resident_bytes(gguf, 4096) == weights + 256 * kv_per_token


def test_draft_bytes_count_on_the_head_only(tmp_path: Path, write_tiny_gguf: Callable[..., None]) -> None:
    path = tmp_path / "draft.gguf"
    write_tiny_gguf(path, tied=True)
    target = ModelProfile(
        "t", "llama", 4, 10 * MiB, {"F32": 1e6}, 64, 3 * MiB, 2 * MiB, {"F32": 1e6}, 4096, 512
    )
    with GGUFFile(path) as gguf:
        drafting = target.with_draft(gguf)
        assert drafting.draft_bytes == draft_resident_bytes(gguf, 512)
    assert drafting.head_resident_bytes == target.head_resident_bytes + drafting.draft_bytes
    assert ModelProfile.from_dict(drafting.to_dict()) == drafting


def test_halda_moves_layers_off_a_head_that_holds_a_draft_model(
    make_model: Callable[..., ModelProfile], make_device: Callable[..., DeviceProfile]
) -> None:
    model = make_model(n_layers=12, layer_mib=200, kv_mib=4)
    per_layer = model.layer_bytes + model.kv_bytes_per_layer
    # A fast head that holds every layer with 100 MiB to spare (it cannot stream: no disk), and
    # a slower follower with room for all of them.
    ram = 12 * per_layer + model.head_resident_bytes + 100 * MiB
    head = replace(make_device("head", gflops=60.0, disk_gbps=0.0), ram_available_bytes=ram)
    follower = make_device("follower", ram_gib=8.0, gflops=10.0)
    plain = halda.solve([head, follower], model)
    assert [n.node_id for n in plain.nodes] == ["head"]
    assert plain.nodes[0].n_layers == 12

    drafting = replace(model, draft_bytes=GiB)
    plan = halda.solve([head, follower], drafting)
    on_head = plan.nodes[0].n_layers
    assert plan.nodes[0].node_id == "head"
    assert on_head * per_layer + drafting.head_resident_bytes <= ram
    assert on_head == (ram - drafting.head_resident_bytes) // per_layer  # as many as fit, no more
    assert sum(n.n_layers for n in plan.nodes) == 12
