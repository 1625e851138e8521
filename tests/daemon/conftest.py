"""A real tiny model (tiny-qwen2, 4 layers) loaded once for the daemon's unit tests, and plans
over it: nothing of the daemon's own code is faked."""

from __future__ import annotations

import pytest

from prima.forward.loader import LoadedModel, load_model
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
