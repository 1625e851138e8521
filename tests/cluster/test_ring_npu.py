"""A ring of real primad processes mixing a CPU node and an "NPU" node: the second daemon runs
`--backend acl` on FakeAcl, a labelled stand-in for Huawei's pyACL that runs the compiled
windows' ONNX with onnxruntime on the CPU (loaded through $PRIMA_TEST_ACL_STANDIN; no NPU result
here). The plan's accel_layers put part of its windows on the "NPU" and the rest on its CPU; the
greedy tokens equal llama.cpp's and the prompt logits are within the acl backend's tolerance.
A session longer than the NPU windows' compiled context is refused with the flag to change, and
the acl daemon's profile carries its accelerator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring, connect_nodes
from prima.engine.generate import GenerateRequest, GenerationDone
from prima.engine.sampling import SamplerConfig
from prima.errors import PrimaError
from prima.model.files import open_model
from prima.plan import Window, plan_from_window_sizes
from prima.scheduler.profile_cache import CACHE_ENV as PROFILE_CACHE_ENV
from prima.weights.window import window_spans
from tests.conftest import load_tiny_oracle, tiny_model_path

pytest.importorskip("onnxruntime")

from prima.backends.acl.backend import AclBackend
from tests.backends.acl.fake_acl import standin_env

pytestmark = pytest.mark.slow

TAG = "tiny-qwen3"  # 4 layers
NPU_CTX = 128  # the oracle prompts and their 16 greedy tokens fit in 65
# node1's budget for the layers its CPU reads: one layer of tiny-qwen3 (~200 KB) fits, two do
# not, so a window with two CPU layers streams them (read, computed, dropped) one by one.
NPU_NODE_BUDGET = "250000"
STOP_IDS = (0, 2)
# The NPU windows the plans below give node1, compiled before it serves (no ATC in a request).
NPU_WINDOWS = ("--npu-window", "0-1", "--npu-window", "2-3", "--npu-window", "0-2")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the ring's acl cache, stand-in ATC and logs go."""
    return tmp_path_factory.mktemp("npu-ring")


@pytest.fixture(scope="module")
def mixed_ring(tmp_root: Path) -> Iterator[LocalRing]:
    """node0 (the head) on the CPU backend, node1 on acl through FakeAcl."""
    tmp = tmp_root
    with pytest.MonkeyPatch.context() as mp:
        for name, value in standin_env(tmp).items():
            mp.setenv(name, value)
        mp.setenv(PROFILE_CACHE_ENV, str(tmp / "profiles"))
        ring = LocalRing.start(
            2,
            tiny_model_path(TAG),
            threads=1,
            log_dir=tmp / "logs",
            extra_args=("--exact",),
            node_args=[
                (),
                (
                    "--backend",
                    "acl",
                    "--npu-ctx",
                    str(NPU_CTX),
                    "--mem-budget",
                    NPU_NODE_BUDGET,
                    *NPU_WINDOWS,
                ),
            ],
        )
    try:
        yield ring
    finally:
        ring.close()


def _compiled_windows(root: Path) -> set[tuple[int, int]]:
    """The layer windows with an offline model in the acl cache under `root`."""
    found = set()
    for om in (root / "acl-cache").rglob("window.om"):
        _, start, end, *_ = om.parent.name.split("-")
        found.add((int(start), int(end)))
    return found


def _request(prompt_ids: list[int], max_tokens: int, n_ctx: int = NPU_CTX) -> GenerateRequest:
    return GenerateRequest(
        tuple(prompt_ids),
        max_tokens,
        SamplerConfig(),
        STOP_IDS,
        n_ctx=n_ctx,
        ubatch=4,
        want_prompt_logits=True,
    )


@pytest.mark.parametrize(
    ("window_sizes", "rounds", "accel_layers"),
    [
        ([2, 2], 1, 1),  # node1's window [0, 2): layer 0 on the NPU, layer 1 on its CPU
        ([1, 1], 2, 1),  # node1's windows [0, 1) and [2, 3), each wholly on the NPU
        ([1, 3], 1, 1),  # node1's window [0, 3): layer 0 on the NPU, 1 and 2 streamed on its CPU
    ],
)
def test_mixed_ring_equals_llama_cpp(
    mixed_ring: LocalRing, tmp_root: Path, window_sizes: list[int], rounds: int, accel_layers: int
) -> None:
    ring = Ring.connect(mixed_ring.addresses, window_sizes=window_sizes, rounds=rounds)
    try:
        plan = plan_from_window_sizes(
            [(n.node_id, n.address) for n in ring.plan.nodes],
            window_sizes,
            rounds,
            ring.plan.n_layers,
            accel_layers=[0, accel_layers],
            epoch=ring.plan.epoch + 1,
        )
        ring.load_plan(plan)
        # node1's NPU pieces are among the windows it compiled (through the stand-in ATC) at start
        npu = {(w.start, w.start + accel_layers) for w in plan.nodes[1].windows}
        assert npu <= _compiled_windows(tmp_root) == {(0, 1), (2, 3), (0, 2)}
        for prompt in load_tiny_oracle(TAG)["prompts"]:
            expected = prompt["f32"]["greedy_token_ids"]
            events = list(ring.generate(_request(prompt["prompt_token_ids"], len(expected))))
            done = events[-1]
            assert isinstance(done, GenerationDone)
            assert [t for t in events if isinstance(t, int)] == expected, prompt["name"]
            f32 = prompt["f32"]["logits"]
            assert done.prompt_logits is not None
            assert np.abs(np.asarray(done.prompt_logits) - f32).max() <= AclBackend.logit_tolerance
        # node1's CPU reads only the layers the NPU does not run, streaming them when they pass
        # its budget
        host = [Window(w.start + accel_layers, w.end) for w in plan.nodes[1].windows]
        files = open_model(tiny_model_path(TAG))
        residency = ring.info()[1].residency
        assert residency is not None
        assert residency.owned_bytes == sum(
            s.n_bytes for w in host for s in window_spans(files.gguf, files.weights, w)
        )
        assert (residency.releases > 0) == (sum(w.n_layers for w in host) > 1)
    finally:
        ring.close()


def test_a_session_beyond_the_npu_context_is_refused(mixed_ring: LocalRing) -> None:
    ring = Ring.connect(mixed_ring.addresses, window_sizes=[2, 2])
    try:
        plan = plan_from_window_sizes(
            [(n.node_id, n.address) for n in ring.plan.nodes],
            [2, 2],
            1,
            ring.plan.n_layers,
            accel_layers=[0, 2],
            epoch=ring.plan.epoch + 1,
        )
        ring.load_plan(plan)
        with pytest.raises(PrimaError, match=f"{NPU_CTX} KV slots.*--npu-ctx"):
            list(ring.generate(_request([5, 6, 7], 2, n_ctx=2 * NPU_CTX)))
        # the daemons keep serving: a session within the context runs
        events = list(ring.generate(_request([5, 6, 7], 2)))
        assert isinstance(events[-1], GenerationDone)
    finally:
        ring.close()


def test_the_npu_node_reports_its_accelerator(mixed_ring: LocalRing) -> None:
    """What Halda plans from: the acl daemon's profile carries the device's memory (FakeAcl's
    1 GiB, less what its loaded windows hold) and a speed; the CPU daemon's has no accelerator."""
    clients, _ = connect_nodes(mixed_ring.addresses)
    try:
        cpu, npu = (c.profile().device for c in clients)
    finally:
        for c in clients:
            c.close()
    assert cpu.accelerator is None
    assert npu.accelerator is not None
    assert npu.accelerator.kind == "acl"
    assert 0 < npu.accelerator.memory_available_bytes <= 1 << 30
    assert npu.accelerator.flops["F32"] > 0
    # the windows it compiled before serving, which alone a plan may give its NPU
    assert set(npu.accelerator.compiled_windows or ()) == {(0, 1), (2, 3), (0, 2)}
