"""The coordinator's side of a ring: ask the daemons who they are, plan (Halda over their
profiles, or windows given by hand), hand each the plan, then talk only to the head (node 0).
It tokenizes and detokenizes; the layers never run here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prima.engine.generate import GenerateRequest, TokenEvent
from prima.errors import NodeError, PlanError, UntrustedNodeError
from prima.net import revocation
from prima.net.client import NodeClient
from prima.net.codec import PROTOCOL_VERSION, WireDType
from prima.net.node_status import NodeStatus
from prima.plan import Plan, even_window_sizes, plan_from_window_sizes
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile

from .file_source import FileSource
from .loopback_only import FORM_A_CLUSTER, usable_addresses
from .planner import ClusterView, HaldaOptions, hand_plan_view, plan_ring
from .readiness import RingFetch, wait_ready

OnProgress = Callable[[int, int, str], None]  # (steps done, steps in all, the step now)

log = logging.getLogger("prima.coordinator")


class Ring:
    """Connected daemons under one plan; a Generator (prima.engine.generate) whose tokens are
    sampled on the head."""

    def __init__(
        self,
        clients: list[NodeClient],
        plan: Plan,
        devices: Sequence[DeviceProfile] = (),
        *,
        fetch_sources: Sequence[str] = (),
        on_fetch: Callable[[RingFetch], None] | None = None,
    ) -> None:
        self.clients = clients
        self.plan = plan
        self.devices = tuple(devices)  # the profiles Halda planned with (empty for a manual plan)
        # Where nodes lacking bytes may fetch them besides each other (the coordinator's file
        # server), and who hears how far they are.
        self.fetch_sources = tuple(fetch_sources)
        self.on_fetch = on_fetch
        self.file_source: FileSource | None = None  # this process serving the file, if it does

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
        skip_untrusted: bool = False,
        on_plan: Callable[[ClusterView], None] | None = None,
        fetch_sources: Sequence[str] = (),
        on_fetch: Callable[[RingFetch], None] | None = None,
        serve_file: Path | None = None,
        on_progress: OnProgress | None = None,
        model: ModelProfile | None = None,
    ) -> Ring:
        """Check that every daemon runs the same model and protocol, then load a plan on all of
        them at an epoch newer than any they hold: Halda's when `halda` is given (and no
        `window_sizes`), else `window_sizes` (an even split if None) over `rounds`. Nodes that
        Halda leaves out are not part of the ring. With `skip_untrusted` (addresses found over
        mDNS, which anyone can advertise), nodes that fail the TLS handshake are left out too.
        `on_plan` sees Halda's plan before it is loaded, and a plan by hand too when some node
        must fetch for it and `model` is given to count the bytes. Nodes holding only part of the model
        fetch their windows (also from `fetch_sources`, and from this process serving
        `serve_file`, the model file it holds) before the ring is returned; `on_fetch` hears
        how far they are.
        `on_progress` hears each node profiled (with Halda), then each node loading the plan."""
        if not addresses:
            raise PlanError("no nodes given; pass --nodes host:port,... or --local-ring N")
        clients, infos = connect_nodes(addresses, timeout_s=timeout_s, skip_untrusted=skip_untrusted)
        addresses = [c.address for c in clients]
        lacking = [c.address for c, info in zip(clients, infos, strict=True) if not info.holds_full_file]
        source = FileSource.start(serve_file, lacking[0]) if serve_file and lacking else None
        if source is not None:
            fetch_sources = (*fetch_sources, source.address)
        try:
            epoch = max(info.plan_epoch for info in infos) + 1
            if halda is not None and not window_sizes:
                view = plan_ring(clients, halda, epoch=epoch, on_progress=on_progress)
                if on_plan is not None:
                    on_plan(view)
                by_address = {c.address: c for c in clients}
                members = [by_address[n.address] for n in view.plan.nodes]
                for c in clients:
                    if c not in members:
                        c.close()
                clients = members
                ring = cls(clients, view.plan, view.devices, fetch_sources=fetch_sources, on_fetch=on_fetch)
                ring.file_source = source
                ring.load_plan(view.plan, wire_dtype, on_progress)
                return ring
            ring = cls(
                clients, _placeholder_plan(infos, addresses), fetch_sources=fetch_sources, on_fetch=on_fetch
            )
            ring.file_source = source
            plan = ring.hand_plan(window_sizes=window_sizes, rounds=rounds, infos=infos)
            if on_plan is not None and model is not None and lacking:
                on_plan(hand_plan_view(clients, plan, model))
            ring.load_plan(plan, wire_dtype, on_progress)
            return ring
        except BaseException:
            for c in clients:
                c.close()
            if source is not None:
                source.close()
            raise

    def load(
        self,
        *,
        window_sizes: Sequence[int] | None = None,
        rounds: int = 1,
        wire_dtype: WireDType = WireDType.F32,
        infos: Sequence[NodeStatus] | None = None,
        on_progress: OnProgress | None = None,
    ) -> Plan:
        """Load a new plan on every node (a higher epoch ends the previous plan's sessions)."""
        plan = self.hand_plan(window_sizes=window_sizes, rounds=rounds, infos=infos)
        self.load_plan(plan, wire_dtype, on_progress)
        return plan

    def hand_plan(
        self,
        *,
        window_sizes: Sequence[int] | None = None,
        rounds: int = 1,
        infos: Sequence[NodeStatus] | None = None,
    ) -> Plan:
        """`window_sizes` (an even split if None) over `rounds` on this ring's nodes, at an epoch
        newer than any they hold."""
        infos = list(infos) if infos is not None else [c.info() for c in self.clients]
        n_layers = infos[0].n_layers
        sizes = list(window_sizes) if window_sizes else even_window_sizes(len(self.clients), n_layers, rounds)
        nodes = [(info.node_id, c.address) for c, info in zip(self.clients, infos, strict=True)]
        epoch = max(info.plan_epoch for info in infos) + 1
        return plan_from_window_sizes(nodes, sizes, rounds, n_layers, epoch=epoch)

    def load_plan(
        self, plan: Plan, wire_dtype: WireDType = WireDType.F32, on_progress: OnProgress | None = None
    ) -> None:
        """Send `plan` (whose nodes are this ring's clients, in order) to every node, then wait
        until nodes that fetch their windows' bytes hold them (see prima.coordinator.readiness).
        `on_progress` hears each node's turn."""
        assert [n.address for n in plan.nodes] == [c.address for c in self.clients]
        # Followers first, head last: once the head has the plan every node can take its traffic.
        order = [*range(1, len(self.clients)), 0]
        for done, i in enumerate(order):
            if on_progress:
                on_progress(done, len(order), f"loading the plan on {plan.nodes[i].node_id}")
            self.clients[i].load_plan(plan, plan.nodes[i].node_id, wire_dtype, self.fetch_sources)
        if on_progress:
            on_progress(len(order), len(order), "done")
        wait_ready(self.clients, plan, on_progress=self.on_fetch)
        self.plan = plan
        log.info("%s", plan.describe())

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        """Run `request` on the head, which samples: token ids as they come, then a
        GenerationDone. Closing the iterator early cancels the generation there."""
        return self.head.generate(request)

    def info(self) -> list[NodeStatus]:
        return [c.info() for c in self.clients]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        if self.file_source is not None:
            self.file_source.close()
            self.file_source = None


def connect_nodes(
    addresses: Sequence[str], *, timeout_s: float = 10.0, skip_untrusted: bool = False
) -> tuple[list[NodeClient], list[NodeStatus]]:
    """A client per address, named by the node's id, after checking that the nodes run one
    protocol and one model file and have distinct ids (NodeError / PlanError saying which).
    Each client then accepts only the certificate of the id its node claimed. With
    `skip_untrusted` (addresses that are only hints, as mDNS adverts are), nodes that fail the
    TLS handshake or do not answer are dropped (with a warning) instead of failing the whole
    ring; PlanError if none is left. Without a cluster identity only loopback daemons are used
    (prima.coordinator.loopback_only)."""
    usable = usable_addresses(addresses, skip=skip_untrusted)
    if not usable:
        raise PlanError(f"none of the {len(addresses)} daemon(s) found is on this machine; {FORM_A_CLUSTER}")
    addresses = usable
    clients = [NodeClient(a, timeout_s=timeout_s) for a in addresses]
    try:
        infos = []
        for c in list(clients):
            try:
                infos.append(c.info())
            except NodeError as exc:
                if not skip_untrusted:
                    raise
                why = "not a member" if isinstance(exc, UntrustedNodeError) else "no answer"
                log.warning("leaving out %s (%s): %s", c.address, why, exc)
                clients.remove(c)
                c.close()
        if not clients:
            raise PlanError(
                f"none of the {len(addresses)} daemon(s) found answered and proved it belongs to this "
                "cluster; check they run, and issue them identities (prima cluster issue, docs/security.md)"
            )
        for c, info in zip(clients, infos, strict=True):
            c.expect(info.node_id)
        _drop_revoked(clients, infos, skip=skip_untrusted, timeout_s=timeout_s)
        check_same_model([c.address for c in clients], infos)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients, infos


def _drop_revoked(
    clients: list[NodeClient], infos: list[NodeStatus], *, skip: bool, timeout_s: float
) -> None:
    """Hold the nodes to this device's revocation list (if it has one): a revoked node is an
    UntrustedNodeError, or with `skip` left out with a warning; PlanError if none is left."""
    revoked = revocation.this_devices_list()
    if revoked is None:
        return
    kept = []
    for c, info in zip(clients, infos, strict=True):
        try:
            revocation.check_node(revoked, c.address, info.node_id, timeout_s)
            kept.append((c, info))
        except NodeError as exc:  # revoked (UntrustedNodeError), or gone since it answered
            if not skip:
                raise
            log.warning("leaving out %s: %s", c.address, exc)
            c.close()
    clients[:] = [c for c, _ in kept]
    infos[:] = [info for _, info in kept]
    if not clients:
        raise PlanError("every daemon found holds a revoked certificate; issue them new identities")


def check_same_model(addresses: Sequence[str], infos: Sequence[NodeStatus]) -> None:
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
