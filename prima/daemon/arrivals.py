"""Activations arriving from peers: checked against the node's plan and the session, then handed
on: back to the head's generation when they have been round the ring, to the head's generation
thread as an OwnHop when they are a decode step at one of the head's own hops, else to the
compute thread (prima.daemon.worker)."""

from __future__ import annotations

from prima.errors import ProtocolError
from prima.net import limits
from prima.net.codec import Activation
from prima.net.status import StaleEpochError

from .plan_holder import PlanHolder
from .sessions import Sessions
from .state import Layout, OwnHop
from .worker import INLINE_MAX_TOKENS, Worker


class Arrivals:
    """Admits what peers send node `node_id` (NodeHandler.accept) under the plan in `plans`, to
    the sessions in `sessions`; `worker` computes what is not the head's to take."""

    def __init__(self, plans: PlanHolder, sessions: Sessions, worker: Worker, node_id: str) -> None:
        self.plans = plans
        self.sessions = sessions
        self.worker = worker
        self.node_id = node_id  # for messages; primad names its node once it has a port

    def accept(self, act: Activation) -> None:
        """Check an arriving activation against the plan and session, then queue it."""
        limits.check_session_id(act.session_id)
        layout = self.plans.need_layout()
        check_epoch(act, layout, self.node_id)
        session = self.sessions.need(act.session_id)
        check_hop(act, layout, session.n_ctx, self.node_id)
        if act.hop_index == len(layout.hops):
            session.hand_back(act, "a peer")  # it has been round the ring
        elif session.results is not None and len(act.positions) <= INLINE_MAX_TOKENS:
            # The head's own hop of a decode step: its generation thread, which waits for the
            # step, computes it. Computed here, the step would wake that thread only after this
            # one's bookkeeping, which holds the GIL it needs.
            session.hand_back(OwnHop(act), "a peer")
        else:
            self.worker.submit(act, layout, session)


def check_epoch(act: Activation, layout: Layout, node_id: str) -> None:
    """StaleEpochError unless `act` is of the plan node `node_id` runs."""
    if act.plan_epoch != layout.plan.epoch:
        raise StaleEpochError(
            f"activation for plan epoch {act.plan_epoch} but node {node_id} runs epoch {layout.plan.epoch}"
        )


def check_hop(act: Activation, layout: Layout, n_ctx: int, node_id: str) -> None:
    """ProtocolError unless `act` is at a hop of this node (or back at the head from the whole
    ring) and within its session's context of `n_ctx` positions."""
    n_hops = len(layout.hops)
    if act.hop_index > n_hops or (act.hop_index == n_hops and not layout.is_head):
        raise ProtocolError(f"hop index {act.hop_index} is outside this plan's {n_hops} hops")
    if act.hop_index < n_hops and layout.hops[act.hop_index].node_index != layout.me:
        hop = layout.hops[act.hop_index]
        raise ProtocolError(
            f"hop {act.hop_index} (window {hop.window}) belongs to node "
            f"{layout.plan.nodes[hop.node_index].node_id}, not {node_id}; the sender's plan differs"
        )
    if int(act.positions[-1]) >= n_ctx:
        raise ProtocolError(f"position {int(act.positions[-1])} is beyond the session's context of {n_ctx}")
