"""Planning running daemons: budgets become the memory Halda sees, the head is the roomiest node,
and each node is asked about the link to its successor. Clients are fakes; no sockets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from prima.coordinator.planner import HaldaOptions, budgeted_device, plan_ring, ring_order
from prima.net.codec import NodeProfile
from prima.scheduler.cost_model import device_cost, ram_layers, streams
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile
from tests.scheduler.conftest import make_device, make_model

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class FakeClient:
    name: str
    address: str
    device: DeviceProfile
    budget: int = 0
    asked: list[str] = field(default_factory=list)

    def profile(self, peer_address: str = "", refresh: bool = False) -> NodeProfile:
        self.asked.append(peer_address)
        return NodeProfile(dataclasses.replace(self.device, node_id="what-the-node-says"), self.budget, 1.0)


@pytest.mark.parametrize("is_head", [False, True])
@pytest.mark.parametrize("layers", [1, 3, 4, 5, 9])
def test_budget_fold_makes_halda_and_the_daemon_agree(is_head: bool, layers: int) -> None:
    """k*u layers fit Halda's RAM rule exactly when their weights fit the daemon's budget."""
    model = make_model(n_layers=12, layer_mib=10, kv_mib=3)
    budget = 4 * model.layer_bytes + 123  # room for 4 layers' weights
    dev = budgeted_device(NodeProfile(make_device("n", ram_gib=8.0), budget), model, is_head=is_head)
    cost = device_cost(dev, model, is_head=is_head)
    assert streams(cost, 1, layers, 0) == (ram_layers(cost, layers, 0) * model.layer_bytes > budget)


def test_budget_never_raises_memory_and_zero_means_none() -> None:
    model = make_model()
    small = make_device("n", ram_gib=0.1)
    assert budgeted_device(NodeProfile(small, 0), model, is_head=False) == small
    folded = budgeted_device(NodeProfile(small, 64 * GiB), model, is_head=False)
    assert folded.ram_available_bytes == small.ram_available_bytes


def test_ring_order_puts_the_roomiest_node_first() -> None:
    model = make_model(layer_mib=10)
    profiles = [
        NodeProfile(make_device("a", ram_gib=2.0), 0),
        NodeProfile(make_device("b", ram_gib=8.0), 20 * MiB),  # a budget below a's RAM
        NodeProfile(make_device("c", ram_gib=4.0), 0),
    ]
    assert ring_order(profiles, model) == [2, 0, 1]


def test_ring_order_puts_a_node_with_the_draft_model_first() -> None:
    """Only the head drafts: the roomiest node that can draft heads the ring, even with less
    memory than another; when none can, memory decides alone."""
    model = make_model(layer_mib=10)
    profiles = [
        NodeProfile(make_device(n, ram_gib=ram), 0) for n, ram in (("a", 2.0), ("b", 8.0), ("c", 4.0))
    ]
    assert ring_order(profiles, model, [True, False, True]) == [2, 0, 1]
    assert ring_order(profiles, model, [True, False, False]) == [0, 1, 2]
    assert ring_order(profiles, model, [False, False, False]) == [1, 0, 2]


def _model() -> ModelProfile:
    return make_model(n_layers=12, layer_mib=100, kv_mib=1)


def test_plan_ring_asks_each_node_about_its_successor() -> None:
    clients = [
        FakeClient(f"n{i}", f"127.0.0.1:{7000 + i}", make_device(f"x{i}", ram_gib=0.5)) for i in range(3)
    ]
    steps: list[tuple[int, int, str]] = []
    view = plan_ring(
        clients,  # type: ignore[arg-type]
        HaldaOptions(_model()),
        epoch=4,
        on_progress=lambda *s: steps.append(s),
    )
    assert [c.asked for c in clients] == [["127.0.0.1:7001"], ["127.0.0.1:7002"], ["127.0.0.1:7000"]]
    assert steps == [*((i, 3, f"profiling n{i}") for i in range(3)), (3, 3, "solving")]
    assert [d.node_id for d in view.devices] == ["n0", "n1", "n2"]  # the coordinator's names win
    assert [d.address for d in view.devices] == [c.address for c in clients]
    assert view.plan.epoch == 4
    assert view.plan.head.node_id == "n0"
    assert math.isfinite(view.plan.predicted_ms_per_token or math.inf)
    # 0.5 GiB holds 5 layers of 100 MiB: all three nodes are needed.
    assert sum(n.n_layers for n in view.plan.nodes) == 12
    assert len(view.plan.nodes) == 3


def test_plan_ring_with_pick_head_reorders_before_measuring_links() -> None:
    clients = [
        FakeClient("small", "h:1", make_device("s", ram_gib=0.5)),
        FakeClient("big", "h:2", make_device("b", ram_gib=2.0)),
    ]
    view = plan_ring(clients, HaldaOptions(_model(), pick_head=True), epoch=1)  # type: ignore[arg-type]
    assert view.devices[0].node_id == "big"
    assert view.plan.head.node_id == "big"
    assert clients[1].asked[-1] == "h:1"  # the head sends to the other node
    assert clients[0].asked[-1] == "h:2"
