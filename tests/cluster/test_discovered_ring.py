"""A ring nobody named: three primad advertise over mDNS on 127.0.0.1, and `prima run` / `prima
plan` with no layer flags find them, profile them (Profile RPC) and plan with Halda; the tokens
equal the single-device engine's. Each module browses its own service type, so other rings on
this host stay invisible."""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.cli.main import main
from prima.coordinator.local_ring import LocalRing
from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.net import discovery
from prima.net.client import NodeClient

from .conftest import start_ring

pytestmark = pytest.mark.slow

N_CTX = 256
MAX_TOKENS = 10
PROMPT = "The capital of France is"
# 13 of SmolLM2's 30 layers (2.2 MB each) fit this budget resident: the plan needs two nodes at
# least (a node may take more than 13 by streaming the rest, when its disk is faster than a hop).
BUDGET = "30M"


@pytest.fixture(scope="module")
def ring(mdns_env: None, smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(3, smollm2_path, ring_logs, mdns=True, mem_budgets=[BUDGET] * 3)


def _reference(model_path: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) from the single-device engine, as `prima run --local` makes them."""
    loaded = load_model(model_path, mode="exact")
    tok = loaded.tokenizer
    engine = LocalEngine(loaded.model, n_ctx=N_CTX)
    ids = prompt_ids(tok, PROMPT)
    stops = sorted(tok.stop_ids)
    result = generate(engine, ids, max_tokens=MAX_TOKENS, sampler=SamplerConfig(), stop_ids=stops)
    return ids, result.token_ids


def test_run_discovers_plans_and_matches_the_single_engine(
    ring: LocalRing, smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", str(MAX_TOKENS), "--ctx", str(N_CTX)]
    assert main([*argv, "--json", "--expect", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert {n["address"] for n in plan["nodes"]} <= set(ring.addresses)
    assert len(plan["nodes"]) >= 2  # no node holds the 30 layers in 30M
    assert math.isfinite(plan["predicted_ms_per_token"])
    assert (out["prompt_token_ids"], out["token_ids"]) == _reference(smollm2_path)


def test_run_on_named_nodes_uses_them(
    ring: LocalRing, smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--nodes (the multicast-free fallback) runs on exactly those daemons, never locally."""
    nodes = ",".join(ring.addresses)
    argv = ["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", str(MAX_TOKENS), "--ctx", str(N_CTX)]
    assert main([*argv, "--json", "--nodes", nodes]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "plan" in out
    assert {n["address"] for n in out["plan"]["nodes"]} <= set(ring.addresses)
    assert (out["prompt_token_ids"], out["token_ids"]) == _reference(smollm2_path)


def test_profile_rpc_returns_a_valid_device_profile(ring: LocalRing) -> None:
    client = NodeClient(ring.addresses[0])
    try:
        first = client.profile(ring.addresses[1])
        again = client.profile()
    finally:
        client.close()
    dev = first.device
    assert dev.node_id == "node0"
    assert {"F32", "Q4_1"} <= set(dev.cpu_flops)
    assert all(v > 0 for v in dev.cpu_flops.values())
    assert 0 < dev.ram_available_bytes <= dev.ram_total_bytes
    assert dev.disk_read_bytes_per_s > 0
    assert dev.mem_bandwidth_bytes_per_s > 0
    assert dev.net_latency_ms > 0
    assert first.mem_budget_bytes == 30 << 20
    assert again.measured_unix_s == first.measured_unix_s  # cached, not measured again
    assert again.device.net_latency_ms == 0.0  # no peer asked about


def test_plan_prints_a_plan_for_the_discovered_nodes(
    ring: LocalRing, smollm2_path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    saved = tmp_path / "cluster.json"
    argv = ["plan", "-m", str(smollm2_path), "--ctx", str(N_CTX), "--expect", "3"]
    assert main([*argv, "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out
    assert "30 layers" in out
    for node in ring.nodes:
        assert node.node_id in out
    # The saved cluster plans the same offline.
    assert main(["plan", "--devices", str(saved), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sum(n["layers"] for n in doc["nodes"]) == 30


def test_ring_status_finds_the_ring_without_nodes(
    ring: LocalRing, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ring", "status", "--json", "--expect", "3", "--discover-timeout", "10"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["address"] for r in rows) == sorted(ring.addresses)
    assert sorted(r["node_id"] for r in rows) == ["node0", "node1", "node2"]
    assert all(r["link_port"] > 0 for r in rows)  # each daemon says where its activation link is
    assert main(["ring", "status", "--expect", "3", "--discover-timeout", "10"]) == 0
    assert capsys.readouterr().out.count("activation link on port") == 3


def test_ring_status_with_no_daemon_says_what_to_do(
    mdns_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(discovery.SERVICE_TYPE_ENV, f"_pe{secrets.token_hex(4)}._tcp.local.")
        assert main(["ring", "status", "--discover-timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "no primad answered" in err
    assert "--nodes" in err


def test_duplicate_node_ids_are_reported_clearly(
    mdns_env: None, smollm2_path: Path, ring_logs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A service type of their own, so the module's good ring is not part of this browse.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(discovery.SERVICE_TYPE_ENV, f"_pd{secrets.token_hex(4)}._tcp.local.")
        twins = LocalRing.start(
            2, smollm2_path, threads=1, log_dir=ring_logs / "twins", names=["twin", "twin"], mdns=True
        )
        try:
            argv = ["-m", str(smollm2_path), "--expect", "2", "--discover-timeout", "10"]
            assert main(["plan", *argv]) == 1
            err = capsys.readouterr().err
            assert "node id 'twin' is advertised by 2 daemons" in err
            assert "give each primad its own --name" in err
            assert main(["run", *argv, "-p", PROMPT, "-n", "2"]) == 1
            assert "give each primad its own --name" in capsys.readouterr().err
        finally:
            twins.close()
