"""What a peer may put in the head's queue of results: the head counts the micro-batches it has
in the ring, and a plan node that sends more (results nobody asked for, or a flood of Aborts)
gets a ProtocolError naming the problem, while the head's memory does not grow and it keeps
generating. Two real daemon runtimes in this process, with gRPC servers and activation links
on 127.0.0.1 and a throwaway cluster CA's certificates."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from prima.daemon.runtime import NodeRuntime
from prima.engine.generate import GenerateRequest, GenerationDone
from prima.engine.sampling import SamplerConfig
from prima.engine.warmup import ensure_compiled
from prima.forward.loader import load_model
from prima.net import credentials
from prima.net.client import NodeClient
from prima.net.codec import Activation, WireDType
from prima.net.link_client import LinkRelay, open_link
from prima.net.link_server import LinkServer
from prima.net.server import start_server
from prima.plan import plan_from_window_sizes
from tests.conftest import load_oracle
from tests.net.link_errors import Errors

EPOCH = 3
D_MODEL = 576
FLOOD = 50  # Aborts


@dataclass
class Node:
    runtime: NodeRuntime
    identity: credentials.Identity
    port: int  # its gRPC server's
    link: LinkServer
    server: grpc.Server


@pytest.fixture(scope="module")
def ring(smollm2_path: Path) -> Iterator[tuple[Node, Node]]:
    ensure_compiled(smollm2_path)
    ca = credentials.ClusterCA.create("head results test")
    nodes = []
    for name in ("head", "peer"):
        identity = ca.issue(name)
        runtime = NodeRuntime(load_model(smollm2_path, layers=range(0)), name, identity=identity)
        server, port = start_server(runtime, "127.0.0.1", 0, identity=identity)
        link = LinkServer(runtime, "127.0.0.1", 0, identity=identity)
        runtime.link_port = link.port
        nodes.append(Node(runtime, identity, port, link, server))
    plan = plan_from_window_sizes(
        [(n.runtime.node_id, f"127.0.0.1:{n.port}") for n in nodes], [15, 15], 1, 30, epoch=EPOCH
    )
    for n in nodes:
        n.runtime.load_plan(plan, n.runtime.node_id, WireDType.F32, owner="coordinator")
    yield nodes[0], nodes[1]
    for n in nodes:
        n.link.close()
        n.server.stop(grace=None)
        n.runtime.shutdown()


def _peer_link(head: Node, peer: Node, errors: Errors) -> LinkRelay:
    port = head.runtime.link_port
    return LinkRelay(open_link("127.0.0.1", port, peer.identity, "head"), "head", f"127.0.0.1:{port}", errors)


def _refusal(head: Node, peer: Node, act: Activation) -> str:
    """Send `act` to the head as `peer` would, over a link of its own; what the head answers as
    it ends the link."""
    errors = Errors()
    relay = _peer_link(head, peer, errors)
    relay.send(act)
    message = errors.wait()
    relay.close()
    return message


@pytest.mark.parametrize("what", ["a result", "the head's own hop"])
def test_activations_the_head_did_not_ask_for_end_the_link(ring: tuple[Node, Node], what: str) -> None:
    head, peer = ring
    hops = head.runtime.plan.hops()
    own = next(i for i, hop in enumerate(hops) if hop.node_index == 0)
    hop_index = len(hops) if what == "a result" else own
    session_id = f"unasked-{hop_index}"
    head.runtime.head.open_ring_session(session_id, 64)
    try:
        row = np.zeros((1, D_MODEL), np.float32)
        for position in range(3):  # a peer that reconnects is refused each time
            message = _refusal(
                head, peer, Activation(session_id, EPOCH, hop_index, np.array([position]), row)
            )
            assert "did not ask for" in message, what
            assert "0 micro-batch(es) in flight" in message
        session = head.runtime.need_session(session_id)
        assert session.results is not None
        assert session.results.qsize() == 0
    finally:
        head.runtime.head.close_ring_session(session_id)


def test_a_flood_of_aborts_queues_one_error(ring: tuple[Node, Node]) -> None:
    head, peer = ring
    session_id = "aborts"
    head.runtime.head.open_ring_session(session_id, 64)
    try:
        client = NodeClient(f"127.0.0.1:{head.port}", node_id="head", identity=peer.identity)
        for i in range(FLOOD):
            client.abort(session_id, "peer", f"failure {i}")
        client.close()
        results = head.runtime.need_session(session_id).results
        assert results is not None
        assert results.qsize() == 1
        assert "failure 0" in str(results.get_nowait())
    finally:
        head.runtime.head.close_ring_session(session_id)


def test_the_head_still_generates_what_llama_cpp_does(ring: tuple[Node, Node]) -> None:
    """After the floods above (this test runs last in the module), a generation round the ring
    gives llama.cpp's greedy tokens."""
    head, _ = ring
    case = next(p for p in load_oracle("smollm2-135m")["prompts"] if p["name"] == "capital")
    expected = case["quant"]["greedy_token_ids"][:8]
    request = GenerateRequest(tuple(case["prompt_token_ids"]), len(expected), SamplerConfig(), n_ctx=64)
    events = list(head.runtime.generate(request))
    assert isinstance(events[-1], GenerationDone)
    assert [e for e in events if isinstance(e, int)] == expected
