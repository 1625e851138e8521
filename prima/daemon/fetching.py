"""A node that holds only part of its model brings in the bytes of a plan's windows before it
takes the plan on.

Which bytes: prima.model.byte_ranges.needed_ranges (its layers; the embedding and output head
when it is the head). From whom: the peer given with `primad --fetch-from`, then the plan's other
nodes, the first whose manifest shows the same model and every missing byte. The fetch runs
inside LoadPlan, synchronously: the plan only loads once the node can compute its windows, and a
coordinator sees a failed fetch as a failed LoadPlan naming the node. Held pieces in the windows
are re-hashed first, so bytes changed on disk since they were fetched are fetched again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from prima.errors import NodeError, PlanError
from prima.model.byte_ranges import covers, needed_ranges, subtract
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net.client import NodeClient, Transport
from prima.net.fetch import FetchStats, fetch_into, get_manifest
from prima.plan import Plan

log = logging.getLogger("prima.daemon")

GiB = float(1 << 30)


class WindowFetcher:
    """Fetches into `store` the bytes a plan gives this node, from `sources` or the plan's nodes."""

    def __init__(
        self,
        store: SparseFile,
        identity: Transport = None,
        sources: Sequence[str] = (),
        *,
        disk_budget_bytes: int = 0,
    ) -> None:
        self.store = store
        self.identity = identity
        self.sources = tuple(sources)
        self.disk_budget_bytes = disk_budget_bytes  # 0: no cap

    def ensure(self, gguf: GGUFFile, plan: Plan, me: int) -> FetchStats:
        """Hold every byte node `me` of `plan` needs (NodeError naming what is missing if no
        peer has it); nothing to do for a whole model file."""
        stats = FetchStats()
        if not self.store.partial:
            return stats
        needed = needed_ranges(gguf, plan.nodes[me].windows, head=me == 0)
        self.store.verify(needed)
        missing = subtract(needed, self.store.held())
        if not missing:
            return stats
        self._check_disk_budget(plan, me, sum(r.n_bytes for r in missing))
        others = [n.address for i, n in enumerate(plan.nodes) if i != me]
        problems = []
        for address in dict.fromkeys([*self.sources, *others]):
            client = NodeClient(address, identity=self.identity)
            try:
                manifest = get_manifest(client)
                if manifest.fingerprint != self.store.fingerprint or not covers(manifest.held, missing):
                    continue
                t0 = time.monotonic()
                stats = fetch_into(client, self.store, missing)
                log.info(
                    "fetched %d MiB for windows %s from %s in %.1f s",
                    stats.written_bytes >> 20,
                    " ".join(map(str, plan.nodes[me].windows)),
                    address,
                    time.monotonic() - t0,
                )
                return stats
            except NodeError as exc:
                problems.append(str(exc))
            finally:
                client.close()
        lacking = sum(r.n_bytes for r in missing)
        raise NodeError(
            f"node {plan.nodes[me].node_id} holds only part of its model and no peer could send the "
            f"{lacking >> 20} MiB its windows lack; start a primad holding the whole file, or pass "
            "--fetch-from HOST:PORT of one" + (f" ({'; '.join(problems)[:500]})" if problems else "")
        )

    def _check_disk_budget(self, plan: Plan, me: int, missing_bytes: int) -> None:
        """PlanError, before any byte is fetched, when the windows would take the model file
        past primad --disk-budget."""
        if self.disk_budget_bytes <= 0:
            return
        after = self.store.held_bytes() + missing_bytes
        if after <= self.disk_budget_bytes:
            return
        node = plan.nodes[me]
        raise PlanError(
            f"node {node.node_id} would hold {after / GiB:.2f} GiB of the model after fetching the "
            f"{missing_bytes / GiB:.2f} GiB its windows {' '.join(map(str, node.windows))} lack, over its "
            f"--disk-budget of {self.disk_budget_bytes / GiB:.2f} GiB; plan with Halda (it respects the "
            "budget), give this node fewer layers, or restart its primad with a larger --disk-budget"
        )
