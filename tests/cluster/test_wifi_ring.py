"""A ring over emulated Wi-Fi (prima.net.link_shaper in front of each daemon's gRPC port and
activation link, on addresses of their own in 127.0.0.0/8): the daemons measure the shaped link
for Halda, the activations take the shaped links, and the tokens are still the single device's.
bench/bench_wifi.py times the same set-up against Halda's predictions."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.planner import HaldaOptions
from prima.coordinator.ring import Ring
from prima.engine.prompt import prompt_ids
from prima.forward.loader import load_model
from prima.net.link_shaper import LinkShape, shaped_daemons
from prima.scheduler.profile_schema import ModelProfile

from .conftest import N_CTX, reference_tokens, ring_tokens, start_ring

pytestmark = pytest.mark.slow

WIFI = LinkShape(delay_ms=3.0, jitter_ms=1.0, mbit_per_s=400.0)
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def link_ports() -> list[int]:
    return [_free_port(), _free_port()]


@pytest.fixture(scope="module")
def ring(smollm2_path: Path, ring_logs: Path, mdns_env: None, link_ports: list[int]) -> Iterator[LocalRing]:
    node_args = [["--link-port", str(p)] for p in link_ports]
    yield from start_ring(2, smollm2_path, ring_logs / "wifi", node_args=node_args)


def test_daemons_measure_the_shaped_link_for_halda(
    ring: LocalRing, link_ports: list[int], smollm2_path: Path
) -> None:
    model = ModelProfile.from_gguf(load_model(smollm2_path, layers=range(0)).gguf, ctx_tokens=N_CTX)
    with shaped_daemons(ring.addresses, link_ports, WIFI, first_host=21) as (addresses, _):
        planned = Ring.connect(addresses, halda=HaldaOptions(model, refresh=True))
        try:
            devices = planned.devices
        finally:
            planned.close()
    assert len(devices) == 2
    for d in devices:  # a round trip crosses the shaper twice: half of it is one delay at least
        assert d.net_latency_ms >= WIFI.delay_ms, d


def test_a_ring_over_wifi_gives_the_single_device_tokens(
    ring: LocalRing, link_ports: list[int], smollm2_path: Path
) -> None:
    ids = prompt_ids(load_model(smollm2_path, layers=range(0)).tokenizer, PROMPT)
    want = reference_tokens(smollm2_path, ids)
    with shaped_daemons(ring.addresses, link_ports, WIFI, first_host=21) as (addresses, shapers):
        wifi_ring = Ring.connect(addresses, window_sizes=[15, 15], rounds=1)
        try:
            got = ring_tokens(wifi_ring, ids)
        finally:
            wifi_ring.close()
        link_shapers = shapers[1::2]
        assert any(s.accepted for s in link_shapers), "no activation took a shaped activation link"
    assert got == want
