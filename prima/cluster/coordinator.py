"""The coordinator's side of a ring: ask the daemons who they are, hand each the plan, then talk
only to the head (node 0). It tokenizes and detokenizes; the layers never run here."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np

from prima.engine.sampling import SamplerConfig
from prima.errors import NodeError, PlanError
from prima.net.client import ForwardStream, GenerateDone, NodeClient
from prima.net.codec import PROTOCOL_VERSION, NodeStatus, WireDType
from prima.scheduler.plan import Plan, even_window_sizes, plan_from_window_sizes

log = logging.getLogger("prima.cluster")


class Ring:
    """Connected daemons under one plan. `engine(n_ctx)` is an Engine for `generate()`;
    `generate(...)` streams tokens sampled on the head."""

    def __init__(self, clients: list[NodeClient], plan: Plan) -> None:
        self.clients = clients
        self.plan = plan

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
    ) -> Ring:
        """Check that every daemon runs the same model and protocol, then load a plan on all of
        them (an even split unless `window_sizes` is given) at an epoch newer than any they hold."""
        if not addresses:
            raise PlanError("no nodes given; pass --nodes host:port,... or --local-ring N")
        clients = [NodeClient(a, timeout_s=timeout_s) for a in addresses]
        infos = [c.info() for c in clients]
        for c, info in zip(clients, infos, strict=True):
            c.name = info.node_id
        _check_same_model(addresses, infos)
        ring = cls(clients, _placeholder_plan(infos, addresses))
        ring.load(window_sizes=window_sizes, rounds=rounds, wire_dtype=wire_dtype, infos=infos)
        return ring

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
        # Followers first, head last: once the head has the plan every node can take its traffic.
        for i in [*range(1, len(self.clients)), 0]:
            self.clients[i].load_plan(plan, plan.nodes[i].node_id, wire_dtype)
        self.plan = plan
        log.info("%s", plan.describe())
        return plan

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
