"""`primad --mem-budget auto` on a 310B-like board, whose NPU memory is the host's DDR: the
budget for the layers the CPU keeps resident leaves out the NPU's copies of the plan's NPU
layers, charged as Halda plans them (cost_model.npu_layer_bytes: fp16 weights, gears, fp16 KV).
Through FakeAcl with shared_host (no NPU here); the board's memory is a fixed 8 GB reading, so
that the budgets compare exactly on a machine whose free memory moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.daemon import install, node_profile
from prima.forward.loader import LoadedModel, load_model
from prima.net.codec import WireDType
from prima.plan import plan_from_window_sizes
from prima.scheduler.cost_model import device_cost
from prima.scheduler.memory import MemoryLimit
from prima.scheduler.profile_schema import AcceleratorProfile, ModelProfile
from tests.conftest import tiny_model_path
from tests.scheduler.conftest import make_device

pytest.importorskip("onnxruntime")

from tests.backends.acl.fake_acl import fake_cann

N_LAYERS = 4
NPU_CTX = 64
GiB = 1 << 30
BOARD = MemoryLimit(8 * GiB, 5 * GiB, None, 0, 0, 0, 0, "host")  # an 8 GB OrangePi AIpro, 5 GB free


def _auto_budget(loaded: LoadedModel, accel_layers: int) -> int:
    """The budget a daemon measures when a one-node plan with `accel_layers` NPU layers arrives."""
    plan = plan_from_window_sizes(
        [("opi", "127.0.0.1:1")], [N_LAYERS], 1, N_LAYERS, accel_layers=[accel_layers]
    )
    layout, _ = install.build_layout(
        loaded, plan, 0, WireDType.F32, node_id="opi", budget_bytes=None, identity=None
    )
    try:
        assert layout.auto_budget is not None
        return layout.auto_budget
    finally:
        layout.close()
        loaded.model.release_windows()  # the next plan starts from none loaded


def test_the_npu_copies_come_out_of_an_auto_budget_on_a_shared_memory_soc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_profile, "memory_limit", lambda loaded: BOARD)
    with fake_cann(tmp_path, memory_bytes=8 * GiB, shared_host=True):
        loaded = load_model(tiny_model_path("tiny-qwen3"), backend="acl", mode="exact", npu_ctx=NPU_CTX)
        assert loaded.model.backend.shares_ram  # the 310B1 the backend compiles for
        model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=NPU_CTX)
        # what Halda charges one NPU layer of this model on such a board
        accel = AcceleratorProfile(
            kind="acl",
            memory_available_bytes=5 * GiB,
            flops={"F32": 1e11},
            mem_bandwidth_bytes_per_s=20e9,
            shares_ram=True,
        )
        per_layer = device_cost(
            make_device("opi", ram_gib=5.0, accel=accel), model, is_head=True
        ).accel_layer_bytes
        assert per_layer > 0  # Halda would put layers on this NPU
        cpu_only = _auto_budget(loaded, 0)
        head = model.head_resident_bytes
        assert cpu_only == BOARD.weights_budget() - head
        for accel_layers in (1, 2):
            assert _auto_budget(loaded, accel_layers) == cpu_only - accel_layers * per_layer
        loaded.model.backend.close()
