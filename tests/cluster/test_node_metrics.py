"""primad --metrics-port: Prometheus metrics that prometheus_client's parser reads, moving as a
ring generates."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prima.coordinator.ring import Ring

from .conftest import ring_request, start_ring

pytestmark = pytest.mark.slow


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _scrape_labelled(port: int, label: str) -> dict[tuple[str, str], float]:
    """The samples labelled `label`, by (name, label value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels[label]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if label in s.labels
    }


def test_daemon_metrics_move_during_a_generation(smollm2_path: Path, ring_logs: Path) -> None:
    extra = ("--exact", "--metrics-port", "0")
    for local in start_ring(2, smollm2_path, ring_logs / "metrics", extra_args=extra):
        ports = [n.metrics_port for n in local.nodes]
        assert all(isinstance(p, int) and p > 0 for p in ports)
        before = [_scrape(p) for p in ports]  # type: ignore[arg-type]
        steps: list[tuple[int, int, str]] = []
        ring = Ring.connect(local.addresses, on_progress=lambda *s, out=steps: out.append(s))
        tokens: list[int] = []
        during: list[dict[str, float]] = []
        try:
            for event in ring.generate(ring_request([1, 2, 3, 4], 4)):
                if isinstance(event, int):
                    tokens.append(event)
                    if len(tokens) == 2:  # mid-generation: the session is open on both nodes
                        during = [_scrape(p) for p in ports]  # type: ignore[arg-type]
            after = [_scrape(p) for p in ports]  # type: ignore[arg-type]
            per_hop = [_scrape_labelled(p, "hop") for p in ports]  # type: ignore[arg-type]
            transports = [_scrape_labelled(p, "transport") for p in ports]  # type: ignore[arg-type]
            infos = ring.info()
        finally:
            ring.close()
    assert len(tokens) == 4
    # Loading the plan showed each node's turn, followers first, then the end.
    assert steps == [(0, 2, "loading the plan on node1"), (1, 2, "loading the plan on node0"), (2, 2, "done")]
    for b, d, a in zip(before, during, after, strict=True):
        assert "prima_node_owned_weight_bytes" not in b  # no plan yet
        assert d["prima_node_compute_seconds_count"] > b.get("prima_node_compute_seconds_count", 0)
        assert 0 < d["prima_node_resident_weight_bytes"] <= d["prima_node_owned_weight_bytes"]
        assert d["prima_node_sessions"] == 1
        assert d["prima_node_prefetches_total"] > 0
        assert d["prima_node_relay_send_seconds_count"] > 0  # each node sends every token on
        assert a["prima_node_compute_seconds_count"] > d["prima_node_compute_seconds_count"]
        assert a["prima_node_sessions"] == 0
    # Every activation went node to node over the activation links, none over gRPC.
    for sent in transports:
        assert sent[("prima_node_relayed_activations_total", "link")] > 0
        assert ("prima_node_relayed_activations_total", "grpc") not in sent
    # Each node holds one hop; ring order runs node 1 (hop 0) then the head (hop 1), whose output
    # stays on the head. 4 tokens are the prompt's and 3 decode steps.
    for i, (info, labelled) in enumerate(zip(infos, per_hop, strict=True)):
        (hop,) = info.hop_times
        assert hop.hop_index == (i + 1) % 2
        assert hop.steps == 3
        assert hop.compute_ms > 0
        assert (hop.relay_ms > 0) == (i == 1)  # node 1 sends every step back to the head
        assert labelled[("prima_node_hop_steps_total", str(hop.hop_index))] == 3
        assert labelled[("prima_node_hop_compute_seconds_total", str(hop.hop_index))] == pytest.approx(
            hop.compute_ms / 1e3
        )
