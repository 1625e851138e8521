"""prima serve's /metrics for the ring's nodes: each member's Info answer, read at scrape time and
labelled by node and hop; a member that did not answer is down and exports nothing else; a server
that reads no cluster exports no node."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from prima.api.cluster_view import ClusterReading, NodeReading
from prima.api.node_metrics import NodeMetricsCollector
from prima.net.node_status import HopTiming, NodeStatus
from prima.plan import plan_from_window_sizes
from prima.weights.window import Residency

MiB = 1 << 20
PLAN = plan_from_window_sizes([("head", "127.0.0.1:1"), ("other", "127.0.0.1:2")], [10, 20], 1, 30)


def _status(node_id: str, **fields: object) -> NodeStatus:
    return NodeStatus(node_id, 6, "smollm2", "f" * 64, 30, 576, True, "ready", **fields)  # type: ignore[arg-type]


def _scrape(reading: ClusterReading | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(NodeMetricsCollector(lambda: reading))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_each_member_is_exported_by_node_and_hop() -> None:
    head = _status(
        "head",
        sessions=2,
        residency=Residency(
            300 * MiB, 120 * MiB, 200 * MiB, 150 * MiB, 7, 5, bytes_read=64 * MiB, wait_ms=500.0
        ),
        hop_times=(HopTiming(1, steps=40, compute_ms=120.0, relay_ms=8.0),),
    )
    reading = ClusterReading(
        PLAN, (), (NodeReading("127.0.0.1:1", head), NodeReading("127.0.0.1:2", None, "timeout"))
    )
    got = _scrape(reading)
    node = (("node", "head"),)
    hop = (("hop", "1"), ("node", "head"))
    assert got["prima_node_up", node] == 1
    assert got["prima_node_up", (("node", "other"),)] == 0
    assert got["prima_node_sessions", node] == 2
    assert got["prima_node_resident_weight_bytes", node] == 120 * MiB
    assert got["prima_node_owned_weight_bytes", node] == 300 * MiB
    assert got["prima_node_weight_budget_bytes", node] == 150 * MiB
    assert got["prima_node_disk_read_bytes_total", node] == 64 * MiB
    assert got["prima_node_read_wait_seconds_total", node] == 0.5
    assert got["prima_node_hop_steps_total", hop] == 40
    assert got["prima_node_hop_compute_seconds_total", hop] == 0.12
    assert got["prima_node_hop_relay_seconds_total", hop] == 0.008
    # The member that did not answer exports only that it is down.
    assert [key for key in got if ("node", "other") in key[1]] == [("prima_node_up", (("node", "other"),))]


def test_no_cluster_exports_no_node() -> None:
    assert _scrape(None) == {}
