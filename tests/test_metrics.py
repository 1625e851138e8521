"""Prometheus metrics: prima serve's families and a daemon's live in separate registries, and a
daemon's residency is read when scraped, from what the layer windows report then."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY, CollectorRegistry

from prima import metrics
from prima.weights.window import Residency

MiB = 1 << 20


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_serve_and_daemon_families_stay_apart() -> None:
    serve, daemon = _samples(metrics.SERVE_REGISTRY), _samples(REGISTRY)
    assert "prima_generated_tokens_total" in serve
    assert "prima_generated_tokens_total" not in daemon
    assert "prima_node_sessions" in daemon
    assert "prima_node_sessions" not in serve


def test_residency_is_read_when_scraped() -> None:
    now: list[Residency | None] = [None]
    registry = CollectorRegistry()
    registry.register(metrics.ResidencyCollector(lambda: now[0]))
    assert not any(name.startswith("prima_node_") for name in _samples(registry))  # no plan yet
    now[0] = Residency(
        owned_bytes=300 * MiB,
        resident_bytes=120 * MiB,
        peak_resident_bytes=200 * MiB,
        budget_bytes=150 * MiB,
        prefetches=7,
        releases=5,
        bytes_read=64 * MiB,
        wait_ms=250.0,
        pinned_layers=3,
    )
    got = _samples(registry)
    assert got["prima_node_resident_weight_bytes"] == 120 * MiB
    assert got["prima_node_owned_weight_bytes"] == 300 * MiB
    assert got["prima_node_weight_budget_bytes"] == 150 * MiB
    assert got["prima_node_pinned_layers"] == 3
    assert got["prima_node_prefetches_total"] == 7
    assert got["prima_node_releases_total"] == 5
    assert got["prima_node_disk_read_bytes_total"] == 64 * MiB
    assert got["prima_node_read_wait_seconds_total"] == 0.25
