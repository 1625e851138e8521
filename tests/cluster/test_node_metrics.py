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


def test_daemon_metrics_move_during_a_generation(smollm2_path: Path, ring_logs: Path) -> None:
    extra = ("--exact", "--metrics-port", "0")
    for local in start_ring(2, smollm2_path, ring_logs / "metrics", extra_args=extra):
        ports = [n.metrics_port for n in local.nodes]
        assert all(isinstance(p, int) and p > 0 for p in ports)
        before = [_scrape(p) for p in ports]  # type: ignore[arg-type]
        ring = Ring.connect(local.addresses)
        tokens: list[int] = []
        during: list[dict[str, float]] = []
        try:
            for event in ring.generate(ring_request([1, 2, 3, 4], 4)):
                if isinstance(event, int):
                    tokens.append(event)
                    if len(tokens) == 2:  # mid-generation: the session is open on both nodes
                        during = [_scrape(p) for p in ports]  # type: ignore[arg-type]
            after = [_scrape(p) for p in ports]  # type: ignore[arg-type]
        finally:
            ring.close()
    assert len(tokens) == 4
    for b, d, a in zip(before, during, after, strict=True):
        assert "prima_node_owned_weight_bytes" not in b  # no plan yet
        assert d["prima_node_compute_seconds_count"] > b.get("prima_node_compute_seconds_count", 0)
        assert 0 < d["prima_node_resident_weight_bytes"] <= d["prima_node_owned_weight_bytes"]
        assert d["prima_node_sessions"] == 1
        assert d["prima_node_prefetches_total"] > 0
        assert d["prima_node_relay_send_seconds_count"] > 0  # each node sends every token on
        assert a["prima_node_compute_seconds_count"] > d["prima_node_compute_seconds_count"]
        assert a["prima_node_sessions"] == 0
