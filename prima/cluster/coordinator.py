"""The coordinator's side of a ring: ask the daemons who they are, plan (Halda over their
profiles, or windows given by hand), hand each the plan, then talk only to the head (node 0).
It tokenizes and detokenizes; the layers never run here."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from prima.engine.generate import GenerationResult, StopText, TextDecoder, check_prompt
from prima.engine.sampling import SamplerConfig
from prima.errors import NodeError, PlanError
from prima.net.client import ForwardStream, GenerateDone, NodeClient
from prima.net.codec import PROTOCOL_VERSION, NodeStatus, WireDType
from prima.scheduler.plan import Plan, even_window_sizes, plan_from_window_sizes
from prima.scheduler.profile import DeviceProfile

from .planner import HaldaOptions, plan_ring

log = logging.getLogger("prima.cluster")


class Ring:
    """Connected daemons under one plan. `engine(n_ctx)` is an Engine for `generate()`;
    `generate(...)` streams tokens sampled on the head."""

    def __init__(self, clients: list[NodeClient], plan: Plan, devices: Sequence[DeviceProfile] = ()) -> None:
        self.clients = clients
        self.plan = plan
        self.devices = tuple(devices)  # the profiles Halda planned with (empty for a manual plan)

    @property
    def head(self) -> NodeClient:
        return self.clients[0]

    @classmethod
    def connect(
        cls,
        addresses: Sequence[str],
        *,
        window_sizes: Sequence[int] | None = None,
        rounds: int = 1,
        wire_dtype: WireDType = WireDType.F32,
        timeout_s: float = 10.0,
        halda: HaldaOptions | None = None,
    ) -> Ring:
        """Check that every daemon runs the same model and protocol, then load a plan on all of
        them at an epoch newer than any they hold: Halda's when `halda` is given (and no
        `window_sizes`), else `window_sizes` (an even split if None) over `rounds`. Nodes that
        Halda leaves out are not part of the ring."""
        if not addresses:
            raise PlanError("no nodes given; pass --nodes host:port,... or --local-ring N")
        clients, infos = connect_nodes(addresses, timeout_s=timeout_s)
        try:
            epoch = max(info.plan_epoch for info in infos) + 1
            if halda is not None and not window_sizes:
                view = plan_ring(clients, halda, epoch=epoch)
                by_address = {c.address: c for c in clients}
                members = [by_address[n.address] for n in view.plan.nodes]
                for c in clients:
                    if c not in members:
                        c.close()
                clients = members
                ring = cls(clients, view.plan, view.devices)
                ring.load_plan(view.plan, wire_dtype)
                return ring
            ring = cls(clients, _placeholder_plan(infos, addresses))
            ring.load(window_sizes=window_sizes, rounds=rounds, wire_dtype=wire_dtype, infos=infos)
            return ring
        except BaseException:
            for c in clients:
                c.close()
            raise

    def load(
        self,
        *,
        window_sizes: Sequence[int] | None = None,
        rounds: int = 1,
        wire_dtype: WireDType = WireDType.F32,
        infos: Sequence[NodeStatus] | None = None,
    ) -> Plan:
        """Load a new plan on every node (a higher epoch ends the previous plan's sessions)."""
        infos = list(infos) if infos is not None else [c.info() for c in self.clients]
        n_layers = infos[0].n_layers
        sizes = list(window_sizes) if window_sizes else even_window_sizes(len(self.clients), n_layers, rounds)
        nodes = [(info.node_id, c.address) for c, info in zip(self.clients, infos, strict=True)]
        epoch = max(info.plan_epoch for info in infos) + 1
        plan = plan_from_window_sizes(nodes, sizes, rounds, n_layers, epoch=epoch)
        self.load_plan(plan, wire_dtype)
        return plan

    def load_plan(self, plan: Plan, wire_dtype: WireDType = WireDType.F32) -> None:
        """Send `plan` (whose nodes are this ring's clients, in order) to every node."""
        assert [n.address for n in plan.nodes] == [c.address for c in self.clients]
        # Followers first, head last: once the head has the plan every node can take its traffic.
        for i in [*range(1, len(self.clients)), 0]:
            self.clients[i].load_plan(plan, plan.nodes[i].node_id, wire_dtype)
        self.plan = plan
        log.info("%s", plan.describe())

    def engine(self, n_ctx: int, ubatch: int = 0) -> RemoteEngine:
        return RemoteEngine(self, n_ctx, ubatch)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampler: SamplerConfig,
        stop_ids: Sequence[int] = (),
        n_ctx: int = 2048,
        ubatch: int = 0,
    ) -> Iterator[int | GenerateDone]:
        return self.head.generate(
            prompt_ids, max_tokens=max_tokens, sampler=sampler, stop_ids=stop_ids, n_ctx=n_ctx, ubatch=ubatch
        )

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampler: SamplerConfig,
        n_ctx: int,
        stop_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        decoder: TextDecoder | None = None,
        ubatch: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> Iterator[str | GenerationResult]:
        """Like prima.engine.generate.stream, with the sampling done on the head (Generate RPC):
        only token ids cross the network. Text pieces as they become valid UTF-8, then the
        GenerationResult (no prompt logits). A stop string ends the call on the head."""
        prompt, max_tokens = check_prompt(prompt_ids, max_tokens, n_ctx)
        result = GenerationResult(prompt_token_ids=prompt, stop_reason="length")
        text = StopText(decoder, stop_strings)
        t0 = clock()
        t1 = None
        events = self.generate(
            prompt, max_tokens=max_tokens, sampler=sampler, stop_ids=stop_ids, n_ctx=n_ctx, ubatch=ubatch
        )
        try:
            for event in events:
                if t1 is None:
                    t1 = clock()  # the head has run the prompt and sampled once
                if isinstance(event, GenerateDone):
                    result.stop_reason = event.stop_reason or result.stop_reason
                    break
                result.token_ids.append(int(event))
                piece = text.feed(int(event))
                if piece:
                    yield piece
                if text.stopped:
                    result.stop_reason = "stop_string"
                    break
        finally:
            events.close()  # cancels the head's generation if it is still going
        tail = text.finish()
        if tail:
            yield tail
        t2 = clock()
        t1 = t2 if t1 is None else t1
        result.text = text.text
        result.timings.prompt_tokens = len(prompt)
        result.timings.prompt_ms = (t1 - t0) * 1000
        result.timings.generated_tokens = len(result.token_ids)
        result.timings.generate_ms = (t2 - t1) * 1000
        yield result

    def info(self) -> list[NodeStatus]:
        return [c.info() for c in self.clients]

    def close(self) -> None:
        for c in self.clients:
            c.close()


class RemoteEngine:
    """An Engine (for prima.engine.generate) whose forward passes run on the ring: token ids go
    to the head over one Forward stream, the last token's f32 logits come back."""

    def __init__(self, ring: Ring, n_ctx: int, ubatch: int = 0) -> None:
        self.ring = ring
        self.plan = ring.plan
        self.n_ctx = n_ctx
        self._stream = ForwardStream(ring.head, n_ctx, ubatch)
        self._reset = True

    def reset(self) -> None:
        self._reset = True

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        logits = self._stream.forward([int(t) for t in np.asarray(token_ids).reshape(-1)], self._reset)
        self._reset = False
        return logits

    def close(self) -> None:
        self._stream.close()


def connect_nodes(
    addresses: Sequence[str], *, timeout_s: float = 10.0
) -> tuple[list[NodeClient], list[NodeStatus]]:
    """A client per address, named by the node's id, after checking that the nodes run one
    protocol and one model file and have distinct ids (NodeError / PlanError saying which)."""
    clients = [NodeClient(a, timeout_s=timeout_s) for a in addresses]
    try:
        infos = [c.info() for c in clients]
        for c, info in zip(clients, infos, strict=True):
            c.name = info.node_id
        _check_same_model(addresses, infos)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients, infos


def _check_same_model(addresses: Sequence[str], infos: Sequence[NodeStatus]) -> None:
    for addr, info in zip(addresses, infos, strict=True):
        if info.protocol_version != PROTOCOL_VERSION:
            raise NodeError(
                f"node {info.node_id} at {addr} speaks protocol v{info.protocol_version}, this coordinator "
                f"v{PROTOCOL_VERSION}; run the same prima version everywhere"
            )
    prints = {info.model_fingerprint for info in infos}
    if len(prints) > 1:
        which = ", ".join(f"{i.node_id}: {i.model_name} ({i.model_fingerprint[:12]})" for i in infos)
        raise PlanError(
            f"the nodes run different model files ({which}); start every primad with the same --model"
        )
    ids = [info.node_id for info in infos]
    if len(set(ids)) != len(ids):
        raise PlanError(f"two nodes share a node id ({ids}); give each primad its own --name")


def _placeholder_plan(infos: Sequence[NodeStatus], addresses: Sequence[str]) -> Plan:
    """A plan object to hold until `load` makes the real one (one node holds every layer)."""
    nodes = [(infos[0].node_id, addresses[0])]
    return plan_from_window_sizes(nodes, [infos[0].n_layers], 1, infos[0].n_layers)
