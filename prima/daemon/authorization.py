"""Who may call a daemon, once its callers are known by their certificates: the plan belongs to
the coordinator that loaded it, and its sessions to that coordinator and the plan's nodes.
A plaintext daemon checks nobody (it serves only loopback, or --insecure)."""

from __future__ import annotations

from dataclasses import dataclass

from prima.net.limits import shown
from prima.net.status import PermissionDeniedError
from prima.plan import Plan


@dataclass(frozen=True)
class PlanOwnership:
    """A loaded plan and who loaded it: `owner`, the certificate name of its coordinator (None
    when nobody is known, on a plaintext daemon or before any plan)."""

    plan: Plan
    owner: str | None

    def authorize(self, rpc: str, caller: str | None, node_id: str, open_sessions: int) -> None:
        """PermissionDeniedError unless `caller` (the node id in its verified certificate; None
        on a plaintext daemon) may make `rpc` on node `node_id`: the plan is changed only by its
        owner, or by anyone once it has no sessions; anything else only by the owner and the
        plan's nodes."""
        if caller is None or self.owner is None or caller == self.owner:
            return
        if rpc == "LoadPlan":
            if open_sessions:
                raise PermissionDeniedError(
                    f"plan epoch {self.plan.epoch} of node {node_id} belongs to coordinator "
                    f"{shown(self.owner)} and has {open_sessions} open session(s); only it may "
                    "change the plan until they end (a chat's kept session ends after the head's "
                    "--session-idle seconds unused)"
                )
            return
        if caller not in {n.node_id for n in self.plan.nodes}:
            raise PermissionDeniedError(
                f"{shown(caller)} is neither a node of plan epoch {self.plan.epoch} nor the coordinator "
                f"that loaded it; it may not call {rpc} on node {node_id}"
            )
