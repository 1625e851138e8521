"""A generation that survives nodes leaving the ring.

FailoverRing runs requests on a Ring's head and remembers the tokens it has passed on. When the
stream fails (a node was killed or hung, found by the head or by this side's own probes of the
head), it closes the stream, asks every known daemon whether it still answers, plans again over
those that do (Halda, or an even split when the ring was planned by hand), loads that plan at a
newer epoch (which ends the old sessions on every survivor), and sends the new head the original
prompt followed by the tokens already generated, with the token budget reduced by as many and the
sampler started at that step. The new ring rebuilds every KV cache from that prompt, the original
part prefilled as before and the generated tokens in micro-batches of decode's arithmetic
(prima.engine.generate.prefill), so the caches hold the unbroken run's bits, and samples on: with
greedy or seeded sampling the tokens are those of the unbroken run, and the caller's stream has no
duplicate and no gap. The head's role moves like any other: the
first node of the new plan embeds and samples.

The nodes planned over are those of RingSpec.addresses plus, for a ring found over mDNS, the ones
advertised now (a browse kept open for the ring's life): a daemon that came back at any address,
or joined, is used from the next re-plan. When no plan fits the nodes left, every survivor still
holding the broken plan is handed that plan again at a newer epoch, which ends the sessions left
behind by a dead head, so none stays open.

A new head that lacks the draft model a generation asks for (`--draft model`) does not refuse
it: the generation goes on drafting by prompt lookup, with a warning here and the reason in its
GenerationDone.draft_off (prima.coordinator.head_draft says why).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prima.engine.generate import GenerateRequest, GenerationDone, TokenEvent
from prima.errors import NodeError, PlanError, PrimaError
from prima.net import discovery
from prima.net.client import GenerateStream, NodeClient
from prima.net.codec import WireDType
from prima.net.liveness import Liveness, probe_nodes, wait_for
from prima.net.node_status import NodeStatus
from prima.plan import Plan, even_window_sizes, plan_from_window_sizes
from prima.scheduler.profile_schema import DeviceProfile

from .head_draft import fall_back
from .loopback_only import usable_addresses
from .plan_summary import describe_plan
from .planner import HaldaOptions, plan_ring
from .ring import Ring, check_same_model

log = logging.getLogger("prima.coordinator")

DEFAULT_MAX_RECOVERIES = 4
# This side only watches the head; the head names a hung follower itself within seconds, so this
# gives up later than the head's own ring timeout would.
COORDINATOR_LIVENESS = Liveness(quiet_s=2.0, probe_timeout_s=1.5, misses=2, give_up_s=900.0)
_END = object()


@dataclass(frozen=True)
class Recovery:
    """One failover, as --json and the logs report it (times in ms)."""

    error: str  # what failed, as the ring reported it
    at_token: int  # tokens generated before the failure
    detect_ms: float  # from the last token received to the error
    replan_ms: float  # probing the daemons, planning and loading the new plan
    replay_ms: float  # from the continued request to its first token (the caches rebuilt)
    nodes: tuple[str, ...]  # the new ring, head first

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["nodes"] = list(self.nodes)
        for key in ("detect_ms", "replan_ms", "replay_ms"):
            out[key] = round(float(out[key]), 3)  # type: ignore[arg-type]
        return out


@dataclass(frozen=True)
class _Replay:
    """A recovery whose continued request has been sent; done when its first token arrives."""

    error: str
    at_token: int
    detect_s: float
    replan_s: float
    sent_at: float
    nodes: tuple[str, ...]

    def done(self, now: float) -> Recovery:
        recovery = Recovery(
            self.error,
            self.at_token,
            self.detect_s * 1000,
            self.replan_s * 1000,
            (now - self.sent_at) * 1000,
            self.nodes,
        )
        log.warning(
            "recovered after %d tokens on %s: detection %.0f ms, re-plan %.0f ms, replay %.0f ms",
            recovery.at_token,
            " -> ".join(recovery.nodes),
            recovery.detect_ms,
            recovery.replan_ms,
            recovery.replay_ms,
        )
        return recovery


@dataclass(frozen=True)
class RingSpec:
    """How to plan the ring again: every daemon it may use (including ones that left, which
    rejoin when they answer), Halda's options or the rounds of a plan made by hand, and for a
    discovered ring `discover`, the addresses advertised now (`advertised`)."""

    addresses: tuple[str, ...]
    halda: HaldaOptions | None = None
    rounds: int = 1
    wire_dtype: WireDType = WireDType.F32
    discover: Callable[[], Sequence[str]] | None = None

    def candidates(self) -> list[str]:
        """The addresses to probe for a re-plan: the known ones, then any newly advertised."""
        found = list(self.discover()) if self.discover is not None else []
        return list(dict.fromkeys([*self.addresses, *found]))


def continuation(request: GenerateRequest, emitted: Sequence[int]) -> GenerateRequest:
    """The request that carries on `request` after `emitted` tokens: they end the prompt, the
    budget shrinks by as many, the sampler starts at that step. The prompt's logits are asked
    for separately (FailoverRing), as this prompt is not the caller's."""
    return dataclasses.replace(
        request,
        prompt_ids=request.prompt_ids + tuple(int(t) for t in emitted),
        max_tokens=request.max_tokens - len(emitted),
        first_step=request.first_step + len(emitted),
        want_prompt_logits=False,
    )


class FailoverRing:
    """A Generator (prima.engine.generate) over `ring` that re-plans and resumes when nodes
    leave. It changes `ring` in place (its clients and plan), so whoever holds the ring sees the
    current one; `recoveries` lists the failovers of the last generation."""

    def __init__(
        self,
        ring: Ring,
        spec: RingSpec,
        *,
        max_recoveries: int = DEFAULT_MAX_RECOVERIES,
        liveness: Liveness = COORDINATOR_LIVENESS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ring = ring
        self.spec = spec
        self.max_recoveries = max_recoveries
        self.liveness = liveness
        self.clock = clock
        self.recoveries: list[Recovery] = []  # of the generation started last
        self._replanning = threading.Lock()
        # The head's Info since the last re-plan; None before one (a fresh start's head refuses
        # a draft model it lacks, see head_draft).
        self.head_status: NodeStatus | None = None
        self._warned_epoch = -1  # the plan whose head's lack of a draft model was logged

    @property
    def plan(self) -> Plan:
        return self.ring.plan

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        """Token ids, then one GenerationDone, across as many failovers as `max_recoveries`;
        closing the iterator early cancels the generation on the current head. Generations may
        run at once (prima serve --parallel): one re-plans, the others resume on its plan."""
        recoveries: list[Recovery] = []
        self.recoveries = recoveries
        emitted: list[int] = []
        epoch = self.ring.plan.epoch
        first, draft_off = self._as_head_drafts(request)
        events = watched_stream(self.ring.head, first, self.liveness)
        last = self.clock()
        replaying: _Replay | None = None  # a recovery until its first token arrives
        try:
            while True:
                try:
                    for event in events:
                        if replaying is not None:
                            recoveries.append(replaying.done(self.clock()))
                            replaying = None
                        if isinstance(event, GenerationDone):
                            yield self._finish(event, request, bool(recoveries), draft_off)
                            return
                        emitted.append(event)
                        last = self.clock()
                        yield event
                    raise NodeError(f"the head {self.ring.head.name} ended the stream without its last reply")
                except NodeError as exc:
                    detected = self.clock()
                    events.close()
                    if replaying is not None:  # failed again before the replay finished
                        recoveries.append(replaying.done(detected))
                    if len(recoveries) >= self.max_recoveries:
                        raise NodeError(f"{exc} (gave up after {len(recoveries)} recoveries)") from None
                    log.warning("ring failed after %d tokens: %s; re-planning", len(emitted), exc)
                    with self._replanning:
                        try:
                            if self.ring.plan.epoch == epoch:  # else another generation re-planned
                                self.replan()
                        except PrimaError as again:
                            raise NodeError(f"{exc}; the ring could not recover: {again}") from None
                        epoch = self.ring.plan.epoch
                        head = self.ring.head
                        nodes = tuple(n.node_id for n in self.ring.plan.nodes)
                    now = self.clock()
                    replaying = _Replay(str(exc), len(emitted), detected - last, now - detected, now, nodes)
                    rest, off = self._as_head_drafts(continuation(request, emitted))
                    draft_off = draft_off or off
                    if rest.max_tokens <= 0 and not request.want_hidden_states:
                        # Every token was out; only the closing reply was lost.
                        recoveries.append(replaying.done(now))
                        yield self._finish(GenerationDone("length", 0.0, 0.0), request, True, draft_off)
                        return
                    last = now
                    events = watched_stream(head, rest, self.liveness)
        finally:
            events.close()

    def replan(self) -> None:
        """Plan over the daemons that answer now and load that plan on them at a newer epoch;
        PlanError (saying what is missing) when they cannot hold the model, after ending the
        broken plan's sessions on the survivors."""
        addresses = self.spec.candidates()
        clients, infos = reachable_nodes(addresses, self.liveness.probe_timeout_s)
        if not clients:
            raise PlanError(f"none of the daemons ({', '.join(addresses)}) answers; restart primad on them")
        old = self.ring.plan
        holding = {c.address for c, i in zip(clients, infos, strict=True) if i.plan_epoch == old.epoch}
        if {c.address for c in self.ring.clients} <= holding:
            for c in clients:
                c.close()
            raise PlanError("every node of the ring still answers with its plan, so no node left")
        members: list[NodeClient] = []
        try:
            check_same_model([c.address for c in clients], infos)
            epoch = max(max(i.plan_epoch for i in infos), old.epoch) + 1
            plan, devices = self._plan(clients, infos, epoch)
            by_address = {c.address: c for c in clients}
            members = [by_address[n.address] for n in plan.nodes]
            Ring(members, plan, devices).load_plan(plan, self.spec.wire_dtype)
            head_status = next(i for c, i in zip(clients, infos, strict=True) if c is members[0])
        except PrimaError:
            members = []
            retire_sessions(clients, infos, old, self.spec.wire_dtype)
            raise
        finally:
            for c in clients:
                if c not in members:
                    c.close()
        for c in self.ring.clients:
            c.close()
        self.ring.clients, self.ring.devices, self.ring.plan = members, tuple(devices), plan
        self.head_status = head_status
        model = self.spec.halda.model if self.spec.halda is not None else None
        log.warning("re-planned, epoch %d: %s", plan.epoch, describe_plan(plan, devices, model))

    def _plan(
        self, clients: list[NodeClient], infos: list[NodeStatus], epoch: int
    ) -> tuple[Plan, tuple[DeviceProfile, ...]]:
        """Halda's plan over `clients`, or an even split when the ring was planned by hand."""
        if self.spec.halda is not None:
            view = plan_ring(clients, self.spec.halda, epoch=epoch)
            return view.plan, view.devices
        n_layers = infos[0].n_layers
        sizes = even_window_sizes(len(clients), n_layers, self.spec.rounds)
        nodes = [(i.node_id, c.address) for c, i in zip(clients, infos, strict=True)]
        return plan_from_window_sizes(nodes, sizes, self.spec.rounds, n_layers, epoch=epoch), ()

    def _as_head_drafts(self, request: GenerateRequest) -> tuple[GenerateRequest, str]:
        """`request` as the head of the last re-plan can draft it, and why its drafts changed
        ("" if not); logged as a warning once per plan."""
        head = self.head_status
        if head is None:
            return request, ""
        request, reason = fall_back(request, head)
        if reason:
            epoch = self.ring.plan.epoch
            (log.debug if self._warned_epoch == epoch else log.warning)("drafts changed: %s", reason)
            self._warned_epoch = epoch
        return request, reason

    def _finish(
        self, done: GenerationDone, request: GenerateRequest, resumed: bool, draft_off: str = ""
    ) -> GenerationDone:
        """The closing event, with why the drafts changed; after a failover the prompt's logits
        (if asked for) come from one more prefill of the caller's prompt, as the last request's
        prompt was not it."""
        if draft_off:
            done = dataclasses.replace(done, draft_off=draft_off)
        if not (resumed and request.want_prompt_logits):
            return done
        ask, _ = self._as_head_drafts(dataclasses.replace(request, max_tokens=0, first_step=0))
        for event in watched_stream(self.ring.head, ask, self.liveness):
            if isinstance(event, GenerationDone):
                return dataclasses.replace(done, prompt_logits=event.prompt_logits)
        return done

    # -- what Ring offers, for holders of a Session's generator --------------------------------
    @property
    def clients(self) -> list[NodeClient]:
        return self.ring.clients

    def info(self) -> list[NodeStatus]:
        return self.ring.info()

    def close(self) -> None:
        self.ring.close()


def advertised(watch: discovery.AdvertWatch, fingerprint: str) -> list[str]:
    """The addresses `watch` has seen advertised by daemons of the model with `fingerprint`."""
    return [a.address for a in watch.adverts() if a.model_fingerprint == fingerprint]


def reachable_nodes(addresses: Sequence[str], timeout_s: float) -> tuple[list[NodeClient], list[NodeStatus]]:
    """Clients (named by node id) for the daemons among `addresses` that answer Info within
    `timeout_s` (and, with TLS, prove cluster membership), in the order given, with their Info."""
    clients, infos = [], []
    for address in usable_addresses(addresses, skip=True):  # no identity: loopback only
        client = NodeClient(address)
        try:
            info = client.info(timeout_s=timeout_s)
        except NodeError as exc:
            log.info("leaving out %s: %s", address, exc)
            client.close()
            continue
        client.expect(info.node_id)  # with TLS, later calls prove the id it claimed
        clients.append(client)
        infos.append(info)
    return clients, infos


def retire_sessions(
    clients: Sequence[NodeClient], infos: Sequence[NodeStatus], plan: Plan, wire_dtype: WireDType
) -> None:
    """End the sessions a broken ring left on the nodes in `clients` that still hold `plan`
    (a dead head cannot close them): each loads the same plan at a newer epoch, which drops
    every session of the old one and keeps its windows."""
    by_address = {n.address: n.node_id for n in plan.nodes}
    epoch = max([plan.epoch, *(i.plan_epoch for i in infos)]) + 1
    again = dataclasses.replace(plan, epoch=epoch)
    for client, info in zip(clients, infos, strict=True):
        if info.plan_epoch != plan.epoch or info.sessions == 0 or client.address not in by_address:
            continue
        try:
            client.load_plan(again, by_address[client.address], wire_dtype)
            log.info("ended the broken ring's sessions on %s", client.name)
        except PrimaError as exc:
            log.warning("could not end the broken ring's sessions on %s: %s", client.name, exc)


def watched_stream(head: NodeClient, request: GenerateRequest, liveness: Liveness) -> Iterator[TokenEvent]:
    """The head's Generate stream, read on a helper thread so that a head that hangs (stopped,
    cut off) is found by probing it during silences instead of waiting on the socket."""
    stream = GenerateStream(head, request)
    items: queue.SimpleQueue[object] = queue.SimpleQueue()

    def pump() -> None:
        try:
            for event in stream:
                items.put(event)
            items.put(_END)
        except NodeError as exc:
            items.put(exc)

    reader = threading.Thread(target=pump, name="prima-generate", daemon=True)
    reader.start()
    try:
        while True:
            item = wait_for(
                lambda timeout_s: items.get(timeout=timeout_s),
                lambda timeout_s: probe_nodes([head], timeout_s),
                liveness,
                what=f"generation on the head {head.name}",
            )
            if item is _END:
                return
            if isinstance(item, NodeError):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stream.cancel()
        reader.join(timeout=liveness.probe_timeout_s)
