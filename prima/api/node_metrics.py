"""`prima serve`'s /metrics for the ring's nodes: what each member answers to Info, read when
scraped and labelled by node, so one scrape of the server shows the whole ring (each primad
--metrics-port shows more of its own). The hop families are the numbers the web page's hop rows
and node cards divide: compute seconds over steps is a node's decode time per token there too."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prima.api.cluster_view import ClusterReading


class NodeMetricsCollector(Collector):
    """The nodes of `read()` (None: this server reads no cluster, and exports no node)."""

    def __init__(self, read: Callable[[], ClusterReading | None]) -> None:
        self._read = read

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # the families depend on the ring at scrape time; none is read at register

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        reading = self._read()
        if reading is None:
            return
        node = ["node"]
        up = GaugeMetricFamily(
            "prima_node_up", "1 if the node answered Info at this scrape, else 0", labels=node
        )
        sessions = GaugeMetricFamily("prima_node_sessions", "Sessions open on the node", labels=node)
        resident = GaugeMetricFamily(
            "prima_node_resident_weight_bytes",
            "Layer weights in the node's memory now (mincore)",
            labels=node,
        )
        owned = GaugeMetricFamily(
            "prima_node_owned_weight_bytes", "Layer weights the node computes", labels=node
        )
        budget = GaugeMetricFamily(
            "prima_node_weight_budget_bytes", "Layer weights it may keep resident (0: no limit)", labels=node
        )
        read_bytes = CounterMetricFamily(
            "prima_node_disk_read_bytes", "Bytes the node's prefetch thread read", labels=node
        )
        waits = CounterMetricFamily(
            "prima_node_read_wait_seconds", "Time the node's compute waited for reads", labels=node
        )
        hop = ["node", "hop"]
        steps = CounterMetricFamily(
            "prima_node_hop_steps", "Decode steps through each hop since the node loaded its plan", labels=hop
        )
        compute = CounterMetricFamily(
            "prima_node_hop_compute_seconds", "Time decode steps spent in each hop's layers", labels=hop
        )
        relay = CounterMetricFamily(
            "prima_node_hop_relay_seconds",
            "Time to hand each hop's decode steps to the next node",
            labels=hop,
        )
        for member, r in zip(reading.plan.nodes, reading.nodes, strict=True):
            name = [member.node_id]
            s = r.status
            up.add_metric(name, 0 if s is None else 1)
            if s is None:
                continue
            sessions.add_metric(name, s.sessions)
            if s.residency is not None:
                res = s.residency
                resident.add_metric(name, res.resident_bytes)
                owned.add_metric(name, res.owned_bytes)
                budget.add_metric(name, res.budget_bytes)
                read_bytes.add_metric(name, res.bytes_read)
                waits.add_metric(name, res.wait_ms / 1e3)
            for t in s.hop_times:
                labels = [member.node_id, str(t.hop_index)]
                steps.add_metric(labels, t.steps)
                compute.add_metric(labels, t.compute_ms / 1e3)
                relay.add_metric(labels, t.relay_ms / 1e3)
        yield from (up, sessions, resident, owned, budget, read_bytes, waits, steps, compute, relay)
