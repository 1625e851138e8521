"""The cluster as `prima serve` shows it: GET /v1/cluster, which the web page polls.

Reading the cluster is one function, `read_ring` (or `read_local` for `--local`), so a new way
of talking to the daemons changes one place. `ClusterMonitor` adds what only the server knows:
the times it measured, the per-node read waits per token those imply, and the failures it
saw. Nothing here runs on the generation path; a poll costs one Info RPC per node.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prima.errors import NodeError, ProtocolError
from prima.net.codec import PROTOCOL_VERSION
from prima.net.node_status import HopTiming, NodeStatus
from prima.plan import DroppedDevice, Plan, Window, plan_from_window_sizes
from prima.scheduler.cost_model import member_time, ring_costs
from prima.scheduler.device_probe import os_class, usable_ram_bytes
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile
from prima.weights.window import LayerWindows, Residency, resident_bytes, window_spans

if TYPE_CHECKING:
    from prima.coordinator.ring import Ring
    from prima.engine.generate import Timings
    from prima.forward.loader import LoadedModel
    from prima.net.client import NodeClient

NODE_INFO_TIMEOUT_S = 2.0  # a poll waits this long for a node before showing it as not answering
MAX_FAILURES = 50  # the newest failures kept for the page


@dataclass(frozen=True)
class NodeReading:
    """One ring member as read now: its Info answer, or why there was none."""

    address: str
    status: NodeStatus | None
    error: str | None = None


@dataclass(frozen=True)
class ClusterReading:
    """The plan, the profiles it was made from (none for a plan by hand) and each member's
    answer, in plan order. `local`: the whole model runs in this process."""

    plan: Plan
    devices: tuple[DeviceProfile, ...]
    nodes: tuple[NodeReading, ...]
    local: bool = False


def read_ring(ring: Ring, timeout_s: float = NODE_INFO_TIMEOUT_S) -> ClusterReading:
    """Ask every member for its Info, in parallel and with a short timeout, so one dead node
    costs the poll one timeout rather than one per node."""

    def ask(client: NodeClient) -> NodeReading:
        try:
            return NodeReading(client.address, client.info(timeout_s))
        except (NodeError, ProtocolError) as exc:
            return NodeReading(client.address, None, str(exc))

    with ThreadPoolExecutor(max_workers=max(1, len(ring.clients)), thread_name_prefix="prima-info") as pool:
        nodes = tuple(pool.map(ask, ring.clients))
    return ClusterReading(ring.plan, ring.devices, nodes)


def read_local(loaded: LoadedModel, streamer: LayerWindows | None) -> ClusterReading:
    """This device as a one-node ring holding every layer: its residency from the engine's
    streamer when the layers stream, else measured over the whole model with mincore."""
    cfg = loaded.weights.config
    name = socket.gethostname() or "this device"
    if streamer is not None:
        residency = streamer.residency()
    else:
        spans = window_spans(loaded.gguf, loaded.weights, Window(0, cfg.n_layers))
        owned = sum(s.n_bytes for s in spans)
        resident = sum(resident_bytes(loaded.gguf, s) for s in spans)
        residency = Residency(owned, resident, resident, 0, 0, 0)
    status = NodeStatus(
        node_id=name,
        protocol_version=PROTOCOL_VERSION,
        model_name=loaded.name,
        model_fingerprint="",
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        healthy=True,
        status="ready",
        plan_epoch=1,
        windows=(Window(0, cfg.n_layers),),
        residency=residency,
    )
    total, usable = usable_ram_bytes()
    device = DeviceProfile(name, "local", os_class(), ram_total_bytes=total, ram_available_bytes=usable)
    plan = plan_from_window_sizes([(name, "local")], [cfg.n_layers], 1, cfg.n_layers)
    return ClusterReading(plan, (device,), (NodeReading("local", status),), local=True)


# -- the view ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSummary:
    """The parts of a DeviceProfile worth a glance; 0 where the profile did not measure it."""

    os: str
    ram_total_bytes: int
    ram_available_bytes: int
    disk_read_bytes_per_s: float
    mem_bandwidth_bytes_per_s: float
    cpu_gflops: dict[str, float]  # by weight format
    accelerator: str | None
    next_hop_ms: float  # measured latency to the next ring member

    @classmethod
    def of(cls, d: DeviceProfile) -> DeviceSummary:
        accel = d.accelerator
        return cls(
            os=d.os,
            ram_total_bytes=d.ram_total_bytes,
            ram_available_bytes=d.ram_available_bytes,
            disk_read_bytes_per_s=d.disk_read_bytes_per_s,
            mem_bandwidth_bytes_per_s=d.mem_bandwidth_bytes_per_s,
            cpu_gflops={fmt: round(f / 1e9, 2) for fmt, f in sorted(d.cpu_flops.items())},
            accelerator=None if accel is None else accel.kind,
            next_hop_ms=d.net_latency_ms,
        )


@dataclass(frozen=True)
class NodeView:
    """One ring member: the plan's windows (one per round), what the node reports, and times.

    `predicted_ms_per_token` is the cost model's time for this node's layers and its hop;
    `compute_ms_per_token` and `relay_ms_per_token` what the node measured per decode step in its
    hops' layers and sends (the sum of its hop rows; None on this device, which has no hops);
    `wait_ms_per_token` what its read-wait counter moved per token (prompt and generated) over
    the latest requests the server finished."""

    index: int
    node_id: str
    address: str
    role: str  # head, node, or local
    answering: bool
    error: str | None
    status: str
    plan_epoch: int
    windows: tuple[Window, ...]
    sessions: int
    residency: Residency | None
    device: DeviceSummary | None
    predicted_ms_per_token: float | None
    compute_ms_per_token: float | None
    relay_ms_per_token: float | None
    wait_ms_per_token: float | None


@dataclass(frozen=True)
class HopView:
    """One step of a forward pass, in ring order, with its predicted ms (layers + the send)
    and what its node measured per decode step since the plan loaded: ms in the hop's layers,
    ms handing the result on, over `measured_steps` steps (None before the first)."""

    node_id: str
    round: int
    window: Window
    predicted_ms: float | None
    measured_steps: int = 0
    compute_ms: float | None = None
    relay_ms: float | None = None

    def with_measured(self, t: HopTiming | None) -> HopView:
        if t is None or t.steps == 0:
            return self
        return dataclasses.replace(
            self, measured_steps=t.steps, compute_ms=t.compute_ms / t.steps, relay_ms=t.relay_ms / t.steps
        )


@dataclass(frozen=True)
class ServedTimes:
    """What this server measured over the generations it finished (decode ms per token)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ms_per_token: float | None = None  # mean over every decode step served
    last: dict[str, float | str] | None = None  # the latest generation's Timings.as_dict()


@dataclass(frozen=True)
class Failure:
    unix_s: float
    message: str


@dataclass(frozen=True)
class ClusterView:
    """The body of GET /v1/cluster (`to_dict`)."""

    model: str
    mode: str  # "ring", "local", or "none" (a server given nothing to read)
    n_layers: int
    rounds: int
    plan_epoch: int
    predicted_ms_per_token: float | None
    measured: ServedTimes
    nodes: tuple[NodeView, ...]
    hops: tuple[HopView, ...]
    dropped: tuple[DroppedDevice, ...]
    failures: tuple[Failure, ...]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        # Windows as [start, end) pairs, as `Plan.to_dict` writes them.
        for node in out["nodes"]:
            node["windows"] = [[w["start"], w["end"]] for w in node["windows"]]
        for hop in out["hops"]:
            hop["window"] = [hop["window"]["start"], hop["window"]["end"]]
        return _finite(out)


def _finite(value: Any) -> Any:
    """`value` with inf and NaN as None: JSON has neither, and browsers refuse Python's Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@dataclass(frozen=True)
class _Predicted:
    own_ms: float  # per token: the node's layers, reads and sends
    ms_per_layer: float  # on the CPU
    accel_delta_ms_per_layer: float  # for each layer of a window on the accelerator
    send_ms: float  # one activation to the next member

    def hop_ms(self, window: Window, accel_layers: int) -> float:
        return (
            self.ms_per_layer * window.n_layers + self.accel_delta_ms_per_layer * accel_layers + self.send_ms
        )


@dataclass(frozen=True)
class _Mark:
    tokens: int
    compute_ms: float
    wait_ms: float


class ClusterMonitor:
    """Builds ClusterViews from `read()` (None: nothing to read, the server alone) and keeps
    what the server learns between polls. Thread-safe: handlers poll while others generate."""

    def __init__(
        self,
        model_id: str,
        read: Callable[[], ClusterReading] | None = None,
        model: ModelProfile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model_id = model_id
        self._read = read
        self._model = model
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: deque[Failure] = deque(maxlen=MAX_FAILURES)
        self._times = ServedTimes()
        self._decode_ms = 0.0
        self._decode_steps = 0
        self._marks: dict[str, _Mark] = {}
        self._wait_rates: dict[str, float] = {}
        self._silent: set[str] = set()  # nodes whose last poll got no answer

    def record_generation(self, timings: Timings) -> None:
        """A generation finished: its prompt and generated tokens and decode time."""
        with self._lock:
            steps = max(timings.generated_tokens - 1, 0)
            self._decode_ms += timings.generate_ms if steps else 0.0
            self._decode_steps += steps
            t = self._times
            self._times = ServedTimes(
                requests=t.requests + 1,
                prompt_tokens=t.prompt_tokens + timings.prompt_tokens,
                generated_tokens=t.generated_tokens + timings.generated_tokens,
                ms_per_token=self._decode_ms / self._decode_steps if self._decode_steps else None,
                last=timings.as_dict(),
            )

    def record_failure(self, message: str) -> None:
        with self._lock:
            self._failures.append(Failure(self._clock(), message))

    def read(self) -> ClusterReading | None:
        """The cluster as its members answer now (None: nothing to read), with no view built
        and nothing recorded (what /metrics scrapes)."""
        return self._read() if self._read is not None else None

    def snapshot(self) -> ClusterView:
        """Read the cluster now. A node that stops answering is logged as a failure once."""
        reading = self._read() if self._read is not None else None
        with self._lock:
            if reading is None:
                return self._view_without_nodes()
            for r in reading.nodes:
                if r.error is not None and r.address not in self._silent:
                    self._silent.add(r.address)
                    self._failures.append(Failure(self._clock(), r.error))
                elif r.error is None:
                    self._silent.discard(r.address)
            return self._view(reading)

    def _view_without_nodes(self) -> ClusterView:
        return ClusterView(
            self.model_id, "none", 0, 0, 0, None, self._times, (), (), (), tuple(self._failures)
        )

    def _view(self, reading: ClusterReading) -> ClusterView:
        plan = reading.plan
        devices = {d.node_id: d for d in reading.devices}
        predicted = self._predicted_ms(plan, devices)
        measured = {t.hop_index: t for r in reading.nodes if r.status is not None for t in r.status.hop_times}
        hops = []
        for i, h in enumerate(plan.hops()):
            node_id = plan.nodes[h.node_index].node_id
            cost = predicted.get(node_id)
            accel = plan.nodes[h.node_index].accel_layers
            hop_ms = None if cost is None else cost.hop_ms(h.window, min(accel, h.window.n_layers))
            hops.append(HopView(node_id, h.round_index, h.window, hop_ms).with_measured(measured.get(i)))
        nodes = []
        for i, (member, r) in enumerate(zip(plan.nodes, reading.nodes, strict=True)):
            s = r.status
            device = devices.get(member.node_id)
            wait = self._update_wait_rate(member.node_id, s.residency if s else None)
            own = predicted.get(member.node_id)
            # One decode token passes every hop of this node once: its hops' times add up.
            mine = [h for h in hops if h.node_id == member.node_id]
            decoded = bool(mine) and all(h.compute_ms is not None for h in mine)
            nodes.append(
                NodeView(
                    index=i,
                    node_id=member.node_id,
                    address=member.address,
                    role="local" if reading.local else ("head" if i == 0 else "node"),
                    answering=s is not None,
                    error=r.error,
                    status=s.status if s else "not answering",
                    plan_epoch=s.plan_epoch if s else 0,
                    windows=member.windows,
                    sessions=s.sessions if s else 0,
                    residency=s.residency if s else None,
                    device=DeviceSummary.of(device) if device else None,
                    predicted_ms_per_token=None if own is None else own.own_ms,
                    compute_ms_per_token=sum(h.compute_ms or 0.0 for h in mine) if decoded else None,
                    relay_ms_per_token=sum(h.relay_ms or 0.0 for h in mine) if decoded else None,
                    wait_ms_per_token=wait,
                )
            )
        return ClusterView(
            model=self.model_id,
            mode="local" if reading.local else "ring",
            n_layers=plan.n_layers,
            rounds=plan.rounds,
            plan_epoch=plan.epoch,
            predicted_ms_per_token=plan.predicted_ms_per_token,
            measured=self._times,
            nodes=tuple(nodes),
            hops=tuple(hops),
            dropped=plan.dropped,
            failures=tuple(self._failures),
        )

    def _predicted_ms(self, plan: Plan, devices: Mapping[str, DeviceProfile]) -> dict[str, _Predicted]:
        """The cost model's times per node, for plans made from profiles (none for a plan by hand)."""
        members = [devices.get(n.node_id) for n in plan.nodes]
        if self._model is None or any(d is None for d in members):
            return {}
        costs = ring_costs([d for d in members if d is not None], self._model)
        sends = len(plan.nodes) > 1
        out = {}
        for node, cost in zip(plan.nodes, costs, strict=True):
            t = member_time(cost, plan.rounds, node.n_layers, node.accel_layers, sends=sends)
            if t is not None:
                out[node.node_id] = _Predicted(
                    t.own_ms,
                    cost.cpu_ms_per_layer,
                    cost.accel_delta_ms_per_layer,
                    cost.hop_ms if sends else 0.0,
                )
        return out

    def _update_wait_rate(self, node_id: str, residency: Residency | None) -> float | None:
        """The node's read-wait ms per token (prompt and generated: reads do not tell them apart)
        since the last poll after which the server finished a request; counters that went back
        (a new plan) start over, and a node that counts no compute time (this device when
        nothing streams) has no rate."""
        if residency is not None:
            tokens = self._times.prompt_tokens + self._times.generated_tokens
            now = _Mark(tokens, residency.compute_ms, residency.wait_ms)
            mark = self._marks.get(node_id)
            if mark is None or now.compute_ms < mark.compute_ms:
                self._marks[node_id] = now
                self._wait_rates.pop(node_id, None)
            elif now.tokens > mark.tokens and now.compute_ms > mark.compute_ms:
                self._wait_rates[node_id] = (now.wait_ms - mark.wait_ms) / (now.tokens - mark.tokens)
                self._marks[node_id] = now
        return self._wait_rates.get(node_id)
