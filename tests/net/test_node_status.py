"""A node's Info answer (prima.net.node_status) through its protobuf form: every field comes
back as sent, and a peer's free text and port are bounded on the way in."""

from __future__ import annotations

from prima.net.codec import MAX_SHOWN_CHARS, PROTOCOL_VERSION
from prima.net.node_status import (
    FetchProgress,
    HopTiming,
    NodeStatus,
    node_status_from_proto,
    node_status_to_proto,
)
from prima.net.proto import prima_pb2 as pb
from prima.plan import Window
from prima.weights.window import Residency


def _status(**changes: object) -> NodeStatus:
    fields: dict[str, object] = {
        "node_id": "node1",
        "protocol_version": PROTOCOL_VERSION,
        "model_name": "SmolLM2",
        "model_fingerprint": "ab" * 16,
        "n_layers": 30,
        "d_model": 576,
        "healthy": True,
        "status": "ready",
        "plan_epoch": 3,
        "windows": (Window(0, 10), Window(20, 25)),
        "residency": Residency(100, 80, 90, 120, 4, 2, 1000, 1.5, 0.25, 9.0, 3),
        "sessions": 2,
        "fetch": FetchProgress(3, 50, 100, 1e6, 0.5, "127.0.0.1:7000", "", False),
        "holds_full_file": True,
        "hop_times": (HopTiming(0, 12, 3.5, 0.5), HopTiming(2, 12, 4.0, 0.25)),
        "draft_model_name": "tiny",
        "draft_model_fingerprint": "cd" * 16,
        "link_port": 7101,
    }
    fields.update(changes)
    return NodeStatus(**fields)  # type: ignore[arg-type]


def test_a_node_status_round_trips_field_for_field() -> None:
    status = _status()
    assert node_status_from_proto(node_status_to_proto(status)) == status
    bare = _status(residency=None, fetch=None, windows=(), hop_times=())
    assert node_status_from_proto(node_status_to_proto(bare)) == bare


def test_a_peers_free_text_and_port_are_bounded() -> None:
    msg = node_status_to_proto(_status())
    msg.draft_model_name = "x" * 100_000
    msg.fetch.error = "e" * 100_000
    msg.fetch.source = "s" * 100_000
    msg.link_port = 70_000
    got = node_status_from_proto(msg)
    assert len(got.draft_model_name) == MAX_SHOWN_CHARS
    assert got.fetch is not None
    assert len(got.fetch.error) == len(got.fetch.source) == MAX_SHOWN_CHARS
    assert got.link_port == 0
    assert node_status_from_proto(pb.NodeInfo()).residency is None
