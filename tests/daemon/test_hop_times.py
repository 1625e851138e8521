"""HopTimes keeps per-plan sums for Info and running totals for Prometheus, read at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prima.daemon.hop_times import HopTimes, HopTimesCollector
from prima.net.node_status import HopTiming


def test_a_new_plan_starts_the_sums_over_but_not_the_totals() -> None:
    times = HopTimes()
    times.add_compute(1, 0, 1, 2.0)
    times.add_compute(1, 0, 1, 3.0)
    times.add_relay(1, 0, 0.5)
    times.add_compute(1, 2, 4, 8.0)
    assert times.snapshot(1) == (HopTiming(0, 2, 5.0, 0.5), HopTiming(2, 4, 8.0, 0.0))
    times.add_compute(2, 0, 1, 1.0)
    assert times.snapshot(1) == ()  # an older plan's sums are gone
    assert times.snapshot(2) == (HopTiming(0, 1, 1.0, 0.0),)
    assert times.since_start() == (HopTiming(0, 3, 6.0, 0.5), HopTiming(2, 4, 8.0, 0.0))


def test_prometheus_reads_the_totals_by_hop_when_it_scrapes() -> None:
    times = HopTimes()
    registry = CollectorRegistry()
    registry.register(HopTimesCollector(times.since_start))
    assert b"prima_node_hop_steps_total{" not in generate_latest(registry)  # nothing measured yet
    times.add_compute(1, 1, 1, 250.0)
    times.add_relay(1, 1, 4.0)
    text = generate_latest(registry).decode()
    assert 'prima_node_hop_steps_total{hop="1"} 1.0' in text
    assert 'prima_node_hop_relay_seconds_total{hop="1"} 0.004' in text
    value = registry.get_sample_value("prima_node_hop_compute_seconds_total", {"hop": "1"})
    assert value == pytest.approx(0.25)
