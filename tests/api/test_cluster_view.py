"""GET /v1/cluster's view, over a ring of stand-in clients: each member with its windows,
residency and profile; predictions that add up to the plan's; a node that stops answering shown
and logged once; per-node time per decode token from its hops, disk waits from its counters."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import cast

import pytest

from prima.api.cluster_view import ClusterMonitor, ClusterReading, NodeReading, read_ring
from prima.coordinator.ring import Ring
from prima.engine.generate import Timings
from prima.errors import NodeError
from prima.net.codec import PROTOCOL_VERSION
from prima.net.node_status import HopTiming, NodeStatus
from prima.plan import DroppedDevice, Plan, plan_from_window_sizes
from prima.scheduler.cost_model import predict_ms_per_token, ring_costs
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile
from prima.weights.window import Residency

MiB = 1 << 20
N_LAYERS = 24
WINDOWS = (4, 4, 4)  # two rounds over 24 layers
ROUNDS = 2


def _model() -> ModelProfile:
    return ModelProfile(
        name="synthetic",
        arch="llama",
        n_layers=N_LAYERS,
        layer_bytes=8 * MiB,
        layer_flops={"F32": 2.0 * 8 * MiB},
        kv_bytes_per_token_per_layer=1024,
        input_bytes=4 * MiB,
        output_bytes=4 * MiB,
        output_flops={"F32": 2.0 * 4 * MiB},
        activation_bytes=4096,
        ctx_tokens=256,
    )


def _device(node_id: str) -> DeviceProfile:
    return DeviceProfile(
        node_id=node_id,
        address=f"{node_id}:7070",
        ram_total_bytes=8 << 30,
        ram_available_bytes=4 << 30,
        disk_read_bytes_per_s=1e9,
        mem_bandwidth_bytes_per_s=20e9,
        cpu_flops={"F32": 20e9},
        net_latency_ms=0.5,
        net_bandwidth_bytes_per_s=100e6,
    )


def _plan(predicted: float | None = None, dropped: Sequence[DroppedDevice] = ()) -> Plan:
    nodes = [(f"node{i}", f"node{i}:7070") for i in range(len(WINDOWS))]
    return plan_from_window_sizes(
        nodes, list(WINDOWS), ROUNDS, N_LAYERS, predicted_ms_per_token=predicted, dropped=dropped
    )


def _status(node_id: str, compute_ms: float = 0.0, wait_ms: float = 0.0) -> NodeStatus:
    residency = Residency(
        owned_bytes=64 * MiB,
        resident_bytes=48 * MiB,
        peak_resident_bytes=64 * MiB,
        budget_bytes=56 * MiB,
        prefetches=3,
        releases=1,
        compute_ms=compute_ms,
        wait_ms=wait_ms,
    )
    return NodeStatus(
        node_id, PROTOCOL_VERSION, "synthetic", "f" * 64, N_LAYERS, 64, True, "ready", 7, (), residency
    )


class FakeClient:
    """A NodeClient's Info: a status, or the NodeError of a node that does not answer."""

    def __init__(self, address: str, answer: NodeStatus | NodeError) -> None:
        self.address = address
        self.answer = answer
        self.timeouts: list[float | None] = []

    def info(self, timeout_s: float | None = None) -> NodeStatus:
        self.timeouts.append(timeout_s)
        if isinstance(self.answer, NodeError):
            raise self.answer
        return self.answer


@dataclasses.dataclass
class FakeRing:
    clients: list[FakeClient]
    plan: Plan
    devices: tuple[DeviceProfile, ...]


def _ring(plan: Plan | None = None) -> FakeRing:
    plan = plan or _plan()
    clients = [FakeClient(n.address, _status(n.node_id)) for n in plan.nodes]
    return FakeRing(clients, plan, tuple(_device(n.node_id) for n in plan.nodes))


def _monitor(ring: FakeRing, model: ModelProfile | None = None) -> ClusterMonitor:
    return ClusterMonitor("synthetic", lambda: read_ring(cast(Ring, ring)), model, clock=lambda: 1000.0)


def test_ring_view_has_each_member_with_its_windows_residency_and_profile() -> None:
    dropped = (DroppedDevice("node9", "faster without it"),)
    ring = _ring(_plan(predicted=12.5, dropped=dropped))
    view = _monitor(ring).snapshot()
    assert view.mode == "ring"
    assert (view.n_layers, view.rounds, view.predicted_ms_per_token) == (N_LAYERS, ROUNDS, 12.5)
    assert [n.node_id for n in view.nodes] == ["node0", "node1", "node2"]
    assert [n.role for n in view.nodes] == ["head", "node", "node"]
    assert all(n.answering and n.status == "ready" for n in view.nodes)
    for node, member in zip(view.nodes, ring.plan.nodes, strict=True):
        assert node.windows == member.windows  # one per round
        assert node.residency is not None
        assert node.residency.resident_bytes == 48 * MiB
        assert node.device is not None
        assert node.device.cpu_gflops == {"F32": 20.0}
    # Ring order: node1, node2, then the head, each round.
    assert [(h.node_id, h.round, h.window.start) for h in view.hops][:3] == [
        ("node1", 0, 0),
        ("node2", 0, 4),
        ("node0", 0, 8),
    ]
    assert view.dropped == dropped
    assert all(t == pytest.approx(2.0) for c in ring.clients for t in c.timeouts)


def test_view_is_json_with_windows_as_pairs() -> None:
    body = json.loads(json.dumps(_monitor(_ring()).snapshot().to_dict()))
    assert body["nodes"][1]["windows"] == [[0, 4], [12, 16]]
    assert body["hops"][0]["window"] == [0, 4]
    assert body["nodes"][0]["residency"]["budget_bytes"] == 56 * MiB


def test_view_json_has_no_infinity() -> None:
    """A device that cannot hold or stream its layers is predicted inf ms; JSON says null."""
    ring = _ring(_plan(predicted=float("inf")))
    body = _monitor(ring).snapshot().to_dict()
    assert body["predicted_ms_per_token"] is None
    json.dumps(body, allow_nan=False)


def test_hop_predictions_add_up_to_the_planned_time_per_token() -> None:
    """Equal devices that hold their layers: the trip round the ring is the cost, so its hops
    plus the head's output head are the cost model's prediction for the plan."""
    ring, model = _ring(), _model()
    view = _monitor(ring, model).snapshot()
    head_fixed = ring_costs(ring.devices, model)[0].fixed_ms
    planned = predict_ms_per_token(ring.devices, model, ROUNDS, list(WINDOWS))
    hops = [h.predicted_ms for h in view.hops]
    assert all(ms is not None for ms in hops)
    assert sum(ms for ms in hops if ms is not None) + head_fixed == pytest.approx(planned)
    assert all(n.predicted_ms_per_token is not None for n in view.nodes)


def test_hops_show_what_their_nodes_measured_per_decode_step() -> None:
    ring = _ring()
    # Hop 0 of the ring order is node1's first window; hop 4 is its second.
    measured = (HopTiming(0, steps=4, compute_ms=10.0, relay_ms=2.0), HopTiming(4, steps=0))
    ring.clients[1].answer = dataclasses.replace(_status("node1"), hop_times=measured)
    view = _monitor(ring).snapshot()
    first = view.hops[0]
    assert (first.node_id, first.measured_steps) == ("node1", 4)
    assert (first.compute_ms, first.relay_ms) == (pytest.approx(2.5), pytest.approx(0.5))
    assert all(h.compute_ms is None and h.measured_steps == 0 for h in view.hops[1:])
    assert json.loads(json.dumps(view.to_dict()))["hops"][0]["relay_ms"] == pytest.approx(0.5)


def test_a_plan_by_hand_has_no_profiles_and_no_predictions() -> None:
    ring = _ring()
    ring.devices = ()
    view = _monitor(ring, _model()).snapshot()
    assert all(n.device is None and n.predicted_ms_per_token is None for n in view.nodes)
    assert all(h.predicted_ms is None for h in view.hops)


def test_a_silent_node_is_shown_and_logged_once_per_outage() -> None:
    ring = _ring()
    monitor = _monitor(ring)
    up = ring.clients[2].answer
    ring.clients[2].answer = NodeError("node node2 at node2:7070 did not answer (Info: UNAVAILABLE)")
    for _ in range(3):
        view = monitor.snapshot()
    silent = view.nodes[2]
    assert not silent.answering
    assert silent.status == "not answering"
    assert silent.error is not None
    assert "did not answer" in silent.error
    assert silent.windows == ring.plan.nodes[2].windows  # still shown where the plan put it
    assert [f.message for f in view.failures] == [silent.error]
    ring.clients[2].answer = up
    assert monitor.snapshot().nodes[2].answering
    ring.clients[2].answer = NodeError("gone again")
    assert [f.message for f in monitor.snapshot().failures][-1] == "gone again"
    assert len(monitor.snapshot().failures) == 2


def test_failures_the_server_reports_are_kept_newest_last() -> None:
    monitor = ClusterMonitor("m", clock=iter(range(100)).__next__)
    monitor.record_failure("first")
    monitor.record_failure("second")
    view = monitor.snapshot()
    assert view.mode == "none"
    assert view.nodes == ()
    assert [(f.unix_s, f.message) for f in view.failures] == [(0, "first"), (1, "second")]


def _timings(prompt: int, generated: int, generate_ms: float) -> Timings:
    return Timings(prompt_tokens=prompt, prompt_ms=5.0, generated_tokens=generated, generate_ms=generate_ms)


def test_measured_time_per_token_is_the_mean_decode_step() -> None:
    monitor = ClusterMonitor("m")
    assert monitor.snapshot().measured.ms_per_token is None
    monitor.record_generation(_timings(5, 11, 100.0))  # 10 decode steps
    monitor.record_generation(_timings(5, 31, 600.0))  # 30 decode steps
    measured = monitor.snapshot().measured
    assert measured.requests == 2
    assert (measured.prompt_tokens, measured.generated_tokens) == (10, 42)
    assert measured.ms_per_token == pytest.approx(700.0 / 40)
    assert measured.last is not None
    assert measured.last["ms_per_token"] == pytest.approx(20.0)


def test_a_nodes_time_per_token_is_the_sum_of_its_hops_per_decode_step() -> None:
    """The node card's figures are per decode token, as the hop rows are: node1 runs hops 0 and
    3 (two rounds), so one token costs it both. Its compute counter, which also holds a long
    prompt's prefill, does not enter: divided by prompt and generated tokens it read 3x low."""
    ring = _ring()
    monitor = _monitor(ring)
    measured = (
        HopTiming(0, steps=4, compute_ms=10.0, relay_ms=2.0),
        HopTiming(3, steps=4, compute_ms=6.0, relay_ms=2.0),
    )
    ring.clients[1].answer = dataclasses.replace(_status("node1", compute_ms=0.0), hop_times=measured)
    monitor.snapshot()
    monitor.record_generation(_timings(40, 5, 50.0))
    ring.clients[1].answer = dataclasses.replace(_status("node1", compute_ms=900.0), hop_times=measured)
    view = monitor.snapshot()
    node1 = view.nodes[1]
    assert node1.compute_ms_per_token == pytest.approx(2.5 + 1.5)
    assert node1.relay_ms_per_token == pytest.approx(0.5 + 0.5)
    mine = [h for h in view.hops if h.node_id == "node1"]
    assert node1.compute_ms_per_token == pytest.approx(sum(h.compute_ms or 0.0 for h in mine))
    # Nodes whose hops measured nothing yet show nothing.
    assert view.nodes[0].compute_ms_per_token is None
    assert view.nodes[0].relay_ms_per_token is None
    # One of two hops measured is not a token's time either.
    ring.clients[1].answer = dataclasses.replace(_status("node1"), hop_times=measured[:1])
    assert monitor.snapshot().nodes[1].compute_ms_per_token is None


def test_node_disk_waits_per_token_come_from_its_counters_between_requests() -> None:
    ring = _ring()
    monitor = _monitor(ring)

    def set_counters(compute_ms: float, wait_ms: float = 0.0) -> None:
        for c in ring.clients:
            c.answer = _status(c.answer.node_id, compute_ms, wait_ms)  # type: ignore[union-attr]

    assert monitor.snapshot().nodes[0].wait_ms_per_token is None  # a first reading only marks
    set_counters(150.0, 30.0)  # mid-request: the server has not counted its tokens yet
    assert monitor.snapshot().nodes[0].wait_ms_per_token is None
    monitor.record_generation(_timings(10, 20, 50.0))
    set_counters(300.0, 60.0)
    assert monitor.snapshot().nodes[0].wait_ms_per_token == pytest.approx(60.0 / 30)
    assert monitor.snapshot().nodes[0].wait_ms_per_token == pytest.approx(2.0)  # kept while idle
    set_counters(5.0)  # a new plan starts the counters again
    assert monitor.snapshot().nodes[0].wait_ms_per_token is None


def test_read_ring_asks_every_member_even_when_one_fails() -> None:
    ring = _ring()
    ring.clients[0].answer = NodeError("head down")
    reading = read_ring(cast(Ring, ring))
    assert isinstance(reading, ClusterReading)
    assert [r.error for r in reading.nodes] == ["head down", None, None]
    assert all(len(c.timeouts) == 1 for c in ring.clients)
    assert reading.nodes[1] == NodeReading("node1:7070", ring.clients[1].answer)  # type: ignore[arg-type]
