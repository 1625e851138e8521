"""A node's state as its Info RPC reports it (NodeStatus: plan, windows, residency, fetch
progress, measured hop times) and its protobuf form. Decoding trusts nothing: a peer's free text
is cut to MAX_SHOWN_CHARS."""

from __future__ import annotations

from dataclasses import dataclass

from prima.net.codec import MAX_SHOWN_CHARS
from prima.net.proto import prima_pb2 as pb
from prima.plan import Window
from prima.weights.window import Residency


@dataclass(frozen=True)
class FetchProgress:
    """How far a node is in bringing in the bytes of plan `plan_epoch`'s windows (see
    FetchProgress in prima.proto); `error` says why it stopped short, `done` that the plan loaded."""

    plan_epoch: int
    held_bytes: int
    needed_bytes: int
    rate_bytes_per_s: float = 0.0
    eta_s: float = 0.0
    source: str = ""
    error: str = ""
    done: bool = False

    @property
    def fraction(self) -> float:
        return self.held_bytes / self.needed_bytes if self.needed_bytes else 1.0


@dataclass(frozen=True)
class HopTiming:
    """One hop of the plan as its node measured it: decode steps through it, and the total
    milliseconds they spent in its layers and being handed to the next node."""

    hop_index: int
    steps: int = 0
    compute_ms: float = 0.0
    relay_ms: float = 0.0


@dataclass(frozen=True)
class NodeStatus:
    """What a daemon says about itself (the Info RPC)."""

    node_id: str
    protocol_version: int
    model_name: str
    model_fingerprint: str
    n_layers: int
    d_model: int
    healthy: bool
    status: str
    plan_epoch: int = 0
    windows: tuple[Window, ...] = ()
    residency: Residency | None = None
    sessions: int = 0
    fetch: FetchProgress | None = None
    holds_full_file: bool = False
    hop_times: tuple[HopTiming, ...] = ()
    draft_model_name: str = ""  # primad --draft-model, "" for none: what it drafts with as a head
    draft_model_fingerprint: str = ""
    link_port: int = 0  # its activation link on the same host (prima.net.link_server); 0: none


def node_status_to_proto(s: NodeStatus) -> pb.NodeInfo:
    msg = pb.NodeInfo(
        node_id=s.node_id,
        protocol_version=s.protocol_version,
        model_name=s.model_name,
        model_fingerprint=s.model_fingerprint,
        n_layers=s.n_layers,
        d_model=s.d_model,
        healthy=s.healthy,
        status=s.status,
        plan_epoch=s.plan_epoch,
        windows=[pb.Window(start=w.start, end=w.end) for w in s.windows],
        sessions=s.sessions,
        holds_full_file=s.holds_full_file,
        hop_times=[
            pb.HopTiming(hop_index=h.hop_index, steps=h.steps, compute_ms=h.compute_ms, relay_ms=h.relay_ms)
            for h in s.hop_times
        ],
        draft_model_name=s.draft_model_name,
        draft_model_fingerprint=s.draft_model_fingerprint,
        link_port=s.link_port,
    )
    if s.fetch is not None:
        f = s.fetch
        msg.fetch.CopyFrom(
            pb.FetchProgress(
                plan_epoch=f.plan_epoch,
                held_bytes=f.held_bytes,
                needed_bytes=f.needed_bytes,
                rate_bytes_per_s=f.rate_bytes_per_s,
                eta_s=f.eta_s,
                source=f.source,
                error=f.error,
                done=f.done,
            )
        )
    if s.residency is not None:
        r = s.residency
        msg.residency.CopyFrom(
            pb.Residency(
                owned_bytes=r.owned_bytes,
                resident_bytes=r.resident_bytes,
                peak_resident_bytes=r.peak_resident_bytes,
                budget_bytes=r.budget_bytes,
                prefetches=r.prefetches,
                releases=r.releases,
                bytes_read=r.bytes_read,
                read_ms=r.read_ms,
                wait_ms=r.wait_ms,
                compute_ms=r.compute_ms,
                pinned_layers=r.pinned_layers,
            )
        )
    return msg


def node_status_from_proto(msg: pb.NodeInfo) -> NodeStatus:
    r = msg.residency
    residency = (
        Residency(
            r.owned_bytes,
            r.resident_bytes,
            r.peak_resident_bytes,
            r.budget_bytes,
            r.prefetches,
            r.releases,
            r.bytes_read,
            r.read_ms,
            r.wait_ms,
            r.compute_ms,
            r.pinned_layers,
        )
        if msg.HasField("residency")
        else None
    )
    return NodeStatus(
        node_id=msg.node_id,
        protocol_version=msg.protocol_version,
        model_name=msg.model_name,
        model_fingerprint=msg.model_fingerprint,
        n_layers=msg.n_layers,
        d_model=msg.d_model,
        healthy=msg.healthy,
        status=msg.status,
        plan_epoch=msg.plan_epoch,
        windows=tuple(Window(w.start, w.end) for w in msg.windows),
        residency=residency,
        sessions=msg.sessions,
        fetch=_fetch_progress_from_proto(msg.fetch) if msg.HasField("fetch") else None,
        holds_full_file=msg.holds_full_file,
        hop_times=tuple(HopTiming(h.hop_index, h.steps, h.compute_ms, h.relay_ms) for h in msg.hop_times),
        draft_model_name=msg.draft_model_name[:MAX_SHOWN_CHARS],
        draft_model_fingerprint=msg.draft_model_fingerprint[:MAX_SHOWN_CHARS],
        link_port=msg.link_port if 0 < msg.link_port < 65536 else 0,
    )


def _fetch_progress_from_proto(f: pb.FetchProgress) -> FetchProgress:
    return FetchProgress(
        plan_epoch=f.plan_epoch,
        held_bytes=f.held_bytes,
        needed_bytes=f.needed_bytes,
        rate_bytes_per_s=f.rate_bytes_per_s,
        eta_s=f.eta_s,
        source=f.source[:MAX_SHOWN_CHARS],
        error=f.error[:MAX_SHOWN_CHARS],
        done=f.done,
    )
