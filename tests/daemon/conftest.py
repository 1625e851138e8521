"""A real tiny model (tiny-qwen2, 4 layers) loaded once for the daemon's unit tests, and plans
over it: nothing of the daemon's own code is faked."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.forward.loader import LoadedModel, load_model
from prima.net.codec import Activation, WireDType
from prima.plan import Plan, plan_from_window_sizes
from tests.conftest import tiny_model_path

N_LAYERS = 4


@pytest.fixture(scope="session")
def tiny_daemon_model() -> LoadedModel:
    """tiny-qwen2 as a daemon maps it: no layer validated until a plan names it; exact mode, so
    a ring's logits equal one pass's bit for bit."""
    return load_model(tiny_model_path("tiny-qwen2"), layers=range(0), mode="exact", threads=1)


def solo_plan(node_id: str = "solo", epoch: int = 1) -> Plan:
    """One node holding every layer: the head, with no peer to call."""
    return plan_from_window_sizes([(node_id, "127.0.0.1:1")], [N_LAYERS], 1, N_LAYERS, epoch=epoch)


def pair_plan(me: str = "solo", epoch: int = 1) -> Plan:
    """Two nodes, `me` second (a follower computing the first window, layers 0-1); the head,
    which holds the last window, is never contacted."""
    return plan_from_window_sizes(
        [("head", "127.0.0.1:1"), (me, "127.0.0.1:2")], [2, 2], 1, N_LAYERS, epoch=epoch
    )


@pytest.fixture
def solo_runtime(tiny_daemon_model: LoadedModel) -> Iterator[NodeRuntime]:
    """A plaintext daemon holding every layer of the solo plan: the ring's head, with no peers."""
    runtime = NodeRuntime(tiny_daemon_model, "solo", budget_bytes=0, threads=1)
    runtime.load_plan(solo_plan(), "solo", WireDType.F32)
    yield runtime
    runtime.shutdown()


def embedded(runtime: NodeRuntime, session_id: str, ids: list[int], hop_index: int = 0) -> Activation:
    """The activation a head injects for `ids` at positions 0..: their embeddings."""
    hidden = runtime.model.embed(np.asarray(ids, dtype=np.int64))
    positions = np.arange(len(ids), dtype=np.int64)
    return Activation(session_id, runtime.plan.epoch, hop_index, positions, hidden)
