"""A ring of cluster members only: rogue daemons that advertise the ring's model over mDNS, with
a far better profile, but hold no certificate of this cluster (one with another cluster's, one
plaintext) are never planned and never get a call past the handshake; the run on the honest
daemons equals the single-device engine. Each module browses its own service type."""

from __future__ import annotations

import dataclasses
import json
import logging
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
from prima.net.codec import NodeProfile
from prima.net.credentials import ClusterCA
from prima.net.node_adverts import NodeAdvert
from prima.net.node_status import NodeStatus
from prima.net.server import start_server
from tests.net.hostile_adverts import hostile_adverts

from .conftest import start_ring

pytestmark = pytest.mark.slow

N_CTX = 128
MAX_TOKENS = 6
PROMPT = "The capital of France is"


class RogueHandler:
    """A daemon face that would gladly take the ring: it answers Info like an honest node and
    Profile with 100x the memory; every call that reaches it is recorded."""

    d_model = 576
    vocab_size = 49152
    max_batch_tokens = 512

    def __init__(self, info: NodeStatus, profile: NodeProfile | None) -> None:
        self.calls: list[str] = []
        self._info = info
        self._profile = profile

    def info(self) -> NodeStatus:
        self.calls.append("Info")
        return self._info

    def profile(self, peer_address: str, refresh: bool) -> NodeProfile | None:
        self.calls.append("Profile")
        return self._profile

    def __getattr__(self, name: str) -> object:
        def record(*args: object, **kwargs: object) -> None:
            self.calls.append(name)

        return record


@pytest.fixture(scope="module")
def ring(mdns_env: None, smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(2, smollm2_path, ring_logs, mdns=True)


def test_rogue_daemons_are_never_planned(ring: LocalRing, smollm2_path: Path, capsys, caplog) -> None:
    honest = NodeClient(ring.addresses[0])
    info, profile = honest.info(), honest.profile()
    honest.close()
    better = dataclasses.replace(profile.device, ram_available_bytes=profile.device.ram_available_bytes * 100)
    rogues = []
    servers = []
    ports: list[int] = []
    for name, identity in [
        ("rogue-tls", ClusterCA.create("other").issue("rogue-tls")),
        ("rogue-plain", None),
    ]:
        handler = RogueHandler(dataclasses.replace(info, node_id=name), NodeProfile(better, 0, 0.0))
        server, port = start_server(handler, "127.0.0.1", 0, identity=identity)  # type: ignore[arg-type]
        ports.append(port)
        advert = NodeAdvert(name, "127.0.0.1", port, info.model_fingerprint, info.model_name)
        servers.append((server, discovery.Advertiser(advert, interfaces="127.0.0.1")))
        rogues.append(handler)
    try:
        for _, advertiser in servers:
            advertiser.__enter__()
        argv = ["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", str(MAX_TOKENS), "--ctx", str(N_CTX)]
        # No --expect: the search listens its whole time, so it sees (and checks) the rogues too.
        with caplog.at_level(logging.WARNING, logger="prima.coordinator"):
            assert main([*argv, "--json", "--exact", "--discover-timeout", "6"]) == 0
    finally:
        for server, advertiser in servers:
            advertiser.__exit__(None, None, None)
            server.stop(grace=None)
    out = json.loads(capsys.readouterr().out)
    assert {n["address"] for n in out["plan"]["nodes"]} <= set(ring.addresses)
    assert [r.calls for r in rogues] == [[], []]  # not even Info: the handshake stopped them
    left_out = " ".join(r.getMessage() for r in caplog.records if "leaving out" in r.getMessage())
    assert all(f"127.0.0.1:{port}" in left_out for port in ports)
    loaded = load_model(smollm2_path, mode="exact")
    ids = prompt_ids(loaded.tokenizer, PROMPT)
    engine = LocalEngine(loaded.model, n_ctx=N_CTX)
    stops = sorted(loaded.tokenizer.stop_ids)
    ref = generate(engine, ids, max_tokens=MAX_TOKENS, sampler=SamplerConfig(), stop_ids=stops)
    assert out["token_ids"] == ref.token_ids


def test_clashing_and_garbage_adverts_do_not_break_discovery(
    ring: LocalRing,
    smollm2_path: Path,
    capsys,
    caplog,
) -> None:
    """Adverts are hints: a rogue claiming a genuine node's id, an advert pointing at nothing and
    one for another model neither stop the search nor the run, which uses the genuine nodes."""
    honest = NodeClient(ring.addresses[0])
    info = honest.info()
    honest.close()
    clash = info.node_id  # the rogue claims to be the ring's first node
    handler = RogueHandler(info, None)  # its profile does not matter: it never gets a call
    server, port = start_server(handler, "127.0.0.1", 0, identity=ClusterCA.create("other").issue(clash))  # type: ignore[arg-type]
    fp, name = info.model_fingerprint, info.model_name
    adverts = [
        NodeAdvert(clash, "127.0.0.1", port, fp, name),  # the clash, a live TLS server
        NodeAdvert("node1", "127.0.0.1", 1, fp, name),  # the other id, nobody listening
        NodeAdvert("junk", "127.0.0.1", 2, "00" * 32, "junk"),  # another model
    ]
    advertisers = [discovery.Advertiser(a, interfaces="127.0.0.1") for a in adverts]
    try:
        for advertiser in advertisers:
            advertiser.start()
        argv = ["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", str(MAX_TOKENS), "--ctx", str(N_CTX)]
        assert main([*argv, "--json", "--exact", "--expect", "2", "--discover-timeout", "10"]) == 0
    finally:
        for advertiser in advertisers:
            advertiser.close()
        server.stop(grace=None)
    out = json.loads(capsys.readouterr().out)
    assert {n["address"] for n in out["plan"]["nodes"]} <= set(ring.addresses)
    assert handler.calls == []
    assert out["token_ids"] == _reference(smollm2_path)


def test_members_are_found_past_hostile_adverts(ring: LocalRing, smollm2_path: Path, capsys) -> None:
    """The LAN of issue 36: 16 instances without an address record, 17 malformed TXT records, 40
    dead-port adverts (two claiming the ring's node ids) and a plaintext rogue advertising the
    whole file beside two real primad: `prima nodes --expect 2` finds both members in each of 5
    trials, the full listing marks the rogue as no member, and `prima run --expect 2` runs on
    the members."""
    honest = NodeClient(ring.addresses[0])
    info = honest.info()
    honest.close()
    handler = RogueHandler(dataclasses.replace(info, node_id="a-rogue"), None)
    rogue, port = start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]  # plaintext
    rogue_advert = NodeAdvert(
        "a-rogue", "127.0.0.1", port, info.model_fingerprint, info.model_name, holds_full_file=True
    )
    ids = {"node0", "node1"}
    service_type = discovery.resolve_service_type()
    try:
        with hostile_adverts(
            service_type, info.model_fingerprint, clash_ids=tuple(ids), extra=(rogue_advert,)
        ):
            for _ in range(5):
                assert main(["nodes", "--json", "--expect", "2", "--timeout", "10"]) == 0
                nodes = json.loads(capsys.readouterr().out)["nodes"]
                assert {n["member_id"] for n in nodes if n["membership"] == "member"} == ids
            assert main(["nodes", "--json", "--timeout", "3"]) == 0
            marks = {n["node_id"]: n["membership"] for n in json.loads(capsys.readouterr().out)["nodes"]}
            argv = ["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", str(MAX_TOKENS), "--ctx", str(N_CTX)]
            assert main([*argv, "--json", "--exact", "--expect", "2", "--discover-timeout", "10"]) == 0
    finally:
        rogue.stop(grace=None)
    assert marks["a-rogue"] == "not a member"
    out = json.loads(capsys.readouterr().out)
    assert {n["address"] for n in out["plan"]["nodes"]} <= set(ring.addresses)
    assert handler.calls == []
    assert out["token_ids"] == _reference(smollm2_path)


def _reference(model: Path) -> list[int]:
    loaded = load_model(model, mode="exact")
    engine = LocalEngine(loaded.model, n_ctx=N_CTX)
    stops = sorted(loaded.tokenizer.stop_ids)
    ids = prompt_ids(loaded.tokenizer, PROMPT)
    return generate(engine, ids, max_tokens=MAX_TOKENS, sampler=SamplerConfig(), stop_ids=stops).token_ids
