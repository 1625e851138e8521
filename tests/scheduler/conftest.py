"""Builders for synthetic devices and models: clusters in scheduler tests are plain data."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from prima.scheduler.profile_schema import AcceleratorProfile, DeviceProfile, ModelProfile

MiB = 1 << 20
GiB = 1 << 30


def make_model(
    n_layers: int = 12, layer_mib: float = 200, kv_mib: float = 4, ctx_tokens: int = 1024
) -> ModelProfile:
    """A model whose layers weigh `layer_mib` and whose KV cache of one layer (full ctx) is `kv_mib`."""
    layer_bytes = int(layer_mib * MiB)
    return ModelProfile(
        name="synthetic",
        arch="llama",
        n_layers=n_layers,
        layer_bytes=layer_bytes,
        # Q4-ish: about 4.5 bits per weight, 2 FLOPs per weight.
        layer_flops={"Q4_K": 2.0 * layer_bytes * 8 / 4.5},
        kv_bytes_per_token_per_layer=int(kv_mib * MiB / ctx_tokens),
        input_bytes=64 * MiB,
        output_bytes=64 * MiB,
        output_flops={"Q6_K": 2.0 * 64 * MiB * 8 / 6.5},
        activation_bytes=4096 * 4,
        ctx_tokens=ctx_tokens,
    )


def make_device(
    node_id: str,
    *,
    ram_gib: float = 8.0,
    gflops: float = 20.0,
    mem_gbps: float = 20.0,
    disk_gbps: float = 1.0,
    latency_ms: float = 3.0,
    net_mbps: float = 400.0,
    accel: AcceleratorProfile | None = None,
) -> DeviceProfile:
    return DeviceProfile(
        node_id=node_id,
        address=f"{node_id}:7070",
        os="linux",
        ram_total_bytes=int(max(ram_gib, 1.0) * 2 * GiB),
        ram_available_bytes=int(ram_gib * GiB),
        swap_total_bytes=2 * GiB,
        swap_free_bytes=GiB,
        disk_read_bytes_per_s=disk_gbps * 1e9,
        mem_bandwidth_bytes_per_s=mem_gbps * 1e9,
        cpu_flops={"F32": gflops * 1e9},
        accelerator=accel,
        net_latency_ms=latency_ms,
        net_bandwidth_bytes_per_s=net_mbps * 1e6 / 8 if net_mbps > 0 else math.inf,
    )


def random_cluster(seed: int) -> tuple[list[DeviceProfile], ModelProfile]:
    """2-5 devices with varied memory, disk, compute, network and sometimes an accelerator,
    sized so that some clusters must stream from disk or leave devices out."""
    rng = np.random.default_rng(seed)
    n_layers = int(rng.choice([6, 8, 12]))
    model = make_model(n_layers, layer_mib=float(rng.uniform(100, 400)), kv_mib=float(rng.uniform(1, 40)))
    model_gib = n_layers * model.layer_bytes / GiB
    devices = []
    n_accel = 0
    for i in range(int(rng.integers(2, 6))):
        accel = None
        if n_accel < 2 and rng.random() < 0.35:
            n_accel += 1
            accel = AcceleratorProfile(
                kind="cuda",
                memory_available_bytes=int(rng.uniform(0.1, 0.6) * model_gib * GiB),
                flops={"F32": float(rng.uniform(20, 300)) * 1e9},
                mem_bandwidth_bytes_per_s=float(rng.uniform(50, 400)) * 1e9,
                shares_ram=bool(rng.random() < 0.3),
            )
        devices.append(
            make_device(
                f"d{i}",
                ram_gib=float(rng.uniform(0.15, 0.6)) * model_gib,
                gflops=float(rng.uniform(2, 60)),
                mem_gbps=float(rng.uniform(5, 60)),
                disk_gbps=0.0 if rng.random() < 0.25 else float(rng.uniform(0.5, 5.0)),
                latency_ms=float(rng.uniform(0.5, 30)),
                net_mbps=float(rng.uniform(20, 1000)),
                accel=accel,
            )
        )
    return devices, model


def write_tiny_gguf(path: Path, *, tied: bool) -> None:
    """A 2-layer llama-shaped GGUF: 8-wide embeddings, 2 heads of 4, 1 KV head, 16-token vocab."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_context_length(256)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((8, 8), np.float32))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.zeros((4, 8), np.float16))
        w.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((16, 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((16, 8), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(name="write_tiny_gguf")
def write_tiny_gguf_fixture() -> Callable[..., None]:
    return write_tiny_gguf


@pytest.fixture(name="make_model")
def make_model_fixture() -> Callable[..., ModelProfile]:
    return make_model


@pytest.fixture(name="make_device")
def make_device_fixture() -> Callable[..., DeviceProfile]:
    return make_device


@pytest.fixture(name="random_cluster")
def random_cluster_fixture() -> Callable[[int], tuple[list[DeviceProfile], ModelProfile]]:
    return random_cluster
