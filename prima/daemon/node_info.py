"""What a daemon answers to Info: its model, its plan (or the fetch that precedes it), its
windows' residency, its sessions, its hop times and its draft model, read from its parts when
asked."""

from __future__ import annotations

from prima.engine.draft_model import DraftModel
from prima.forward.loader import LoadedModel
from prima.model.sparse import SparseFile
from prima.net.codec import PROTOCOL_VERSION
from prima.net.node_status import NodeStatus

from .fetching import describe_fetch
from .hop_times import HopTimes
from .plan_holder import PlanHolder
from .sessions import Sessions


class NodeInfo:
    """The Info of a node serving `loaded` (whose fingerprint is `fingerprint`) from `store`,
    under the plan in `plans`, with the sessions in `sessions`; `hop_times` are its worker's,
    `draft_model` its head's."""

    def __init__(
        self,
        loaded: LoadedModel,
        fingerprint: str,
        plans: PlanHolder,
        sessions: Sessions,
        hop_times: HopTimes,
        store: SparseFile,
        draft_model: DraftModel | None = None,
    ) -> None:
        self.loaded = loaded
        self.fingerprint = fingerprint
        self.plans = plans
        self.sessions = sessions
        self.hop_times = hop_times
        self.store = store
        self.draft_model = draft_model

    def status(self, node_id: str, link_port: int) -> NodeStatus:
        """The node's status now, as node `node_id` with its activation link on `link_port`
        (0: none)."""
        layout = self.plans.layout
        cfg = self.loaded.model.config
        pending = self.plans.fetch
        fetch = pending.progress() if pending else None
        status = "ready" if layout else "idle: waiting for a plan"
        if self.sessions.stopping:
            status = f"shutting down: finishing {len(self.sessions)} session(s), taking no new ones"
        draft = self.draft_model
        if layout is None and fetch is not None:
            status = describe_fetch(fetch)
        return NodeStatus(
            node_id=node_id,
            protocol_version=PROTOCOL_VERSION,
            model_name=self.loaded.name,
            model_fingerprint=self.fingerprint,
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            healthy=not (fetch and fetch.error),
            status=status,
            plan_epoch=layout.plan.epoch if layout else fetch.plan_epoch if fetch else 0,
            windows=layout.plan.nodes[layout.me].windows if layout else (),
            residency=layout.windows.residency() if layout else None,
            sessions=len(self.sessions),
            fetch=fetch,
            holds_full_file=self.store.complete,
            hop_times=self.hop_times.snapshot(layout.plan.epoch) if layout else (),
            draft_model_name=draft.name if draft else "",
            draft_model_fingerprint=draft.fingerprint if draft else "",
            link_port=link_port,
        )
