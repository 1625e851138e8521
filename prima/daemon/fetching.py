"""A node that holds only part of its model brings in the bytes of a plan's windows before it
takes the plan on.

Which bytes: prima.model.byte_ranges.needed_ranges (its layers; the embedding and output head
when it is the head). From whom: the peer given with `primad --fetch-from`, the sources the
coordinator named in LoadPlan, then the plan's other nodes: the first whose manifest shows the
same model and every missing byte. Held pieces in the windows are re-hashed first, so bytes
changed on disk since they were fetched are fetched again.

A 40 GB model takes far longer than any RPC deadline, so LoadPlan only starts the fetch
(PlanFetch, on its own thread) and returns; the node reports its progress in Info, refuses
sessions until it holds its windows, and then loads the plan itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from prima.errors import NodeError, PlanError, PrimaError
from prima.model.byte_ranges import Ranges, covers, intersect, needed_ranges, subtract, total_bytes
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net.client import NodeClient, Transport
from prima.net.fetch import FetchCancelled, FetchStats, fetch_into, get_manifest
from prima.net.node_status import FetchProgress
from prima.plan import Plan, windows_text

log = logging.getLogger("prima.daemon")

GiB = float(1 << 30)
Clock = Callable[[], float]
CANCEL_WAIT_S = 10.0  # a cancelled fetch stops at its next piece; wait this long for its thread


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

    def needs(self, gguf: GGUFFile, plan: Plan, me: int) -> tuple[Ranges, Ranges]:
        """(every byte node `me` of `plan` needs, those it lacks), after re-hashing what it holds
        of them; nothing is lacking in a whole model file."""
        needed = needed_ranges(gguf, plan.nodes[me].windows, head=me == 0)
        if not self.store.partial:
            return needed, ()
        self.store.verify(needed)
        return needed, subtract(needed, self.store.held())

    def ensure(
        self,
        gguf: GGUFFile,
        plan: Plan,
        me: int,
        *,
        extra_sources: Sequence[str] = (),
        on_progress: Callable[[str, FetchStats], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> FetchStats:
        """Hold every byte node `me` of `plan` needs (NodeError naming what is missing if no
        peer has it); `on_progress(address, stats)` after each piece written."""
        _, missing = self.needs(gguf, plan, me)
        return self.fetch_missing(
            plan, me, missing, extra_sources=extra_sources, on_progress=on_progress, cancel=cancel
        )

    def fetch_missing(
        self,
        plan: Plan,
        me: int,
        missing: Ranges,
        *,
        extra_sources: Sequence[str] = (),
        on_progress: Callable[[str, FetchStats], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> FetchStats:
        """Bring `missing` in from the first source holding all of it (see `ensure`)."""
        if not missing:
            return FetchStats()
        self.check_disk_budget(plan, me, total_bytes(missing))
        others = [n.address for i, n in enumerate(plan.nodes) if i != me]
        problems = []
        for address in dict.fromkeys([*self.sources, *extra_sources, *others]):
            client = NodeClient(address, identity=self.identity)
            try:
                manifest = get_manifest(client)
                if manifest.fingerprint != self.store.fingerprint or not covers(manifest.held, missing):
                    continue
                t0 = time.monotonic()
                report = (lambda stats, a=address: on_progress(a, stats)) if on_progress else None
                if report:
                    report(FetchStats())  # names the source before its first piece arrives
                stats = fetch_into(client, self.store, missing, on_progress=report, cancel=cancel)
                log.info(
                    "fetched %d MiB for windows %s from %s in %.1f s",
                    stats.written_bytes >> 20,
                    windows_text(plan.nodes[me].windows),
                    address,
                    time.monotonic() - t0,
                )
                return stats
            except NodeError as exc:
                problems.append(str(exc))
                missing = subtract(missing, self.store.held())  # the next source resumes
            finally:
                client.close()
        lacking = sum(r.n_bytes for r in missing)
        raise NodeError(
            f"node {plan.nodes[me].node_id} holds only part of its model and no peer could send the "
            f"{lacking >> 20} MiB its windows lack; start a primad holding the whole file, or pass "
            "--fetch-from HOST:PORT of one" + (f" ({'; '.join(problems)[:500]})" if problems else "")
        )

    def check_disk_budget(self, plan: Plan, me: int, missing_bytes: int) -> None:
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
            f"{missing_bytes / GiB:.2f} GiB its windows {windows_text(node.windows)} lack, over its "
            f"--disk-budget of {self.disk_budget_bytes / GiB:.2f} GiB; plan with Halda (it respects the "
            "budget), give this node fewer layers, or restart its primad with a larger --disk-budget"
        )


class PlanFetch:
    """The fetch of one plan's windows on its own thread, then `on_done(bytes written)` (which
    loads the plan); `progress()` at any time for Info. A failure (no source has the bytes, or loading
    them failed) is kept in the progress's `error`, for the coordinator to show."""

    def __init__(
        self,
        fetcher: WindowFetcher,
        gguf: GGUFFile,
        plan: Plan,
        me: int,
        on_done: Callable[[int], None],
        *,
        extra_sources: Sequence[str] = (),
        clock: Clock = time.monotonic,
    ) -> None:
        self.fetcher = fetcher
        self.gguf = gguf
        self.plan = plan
        self.me = me
        self.on_done = on_done
        self.extra_sources = tuple(extra_sources)
        self.clock = clock
        # Cheap here (LoadPlan's deadline); re-hashing what it holds waits for the thread.
        needed = needed_ranges(gguf, plan.nodes[me].windows, head=me == 0)
        self.needed_bytes = total_bytes(needed)
        self.held_at_start = total_bytes(intersect(needed, fetcher.store.held()))
        # Refused here, in LoadPlan, before a byte is fetched (and again, exactly, after re-hashing).
        fetcher.check_disk_budget(plan, me, self.needed_bytes - self.held_at_start)
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._written_from: dict[str, int] = {}  # bytes written, by source (one may break off)
        self._source = ""
        self._error = ""
        self._done = False
        self._t0 = clock()
        self._thread = threading.Thread(target=self._run, name=f"fetch-epoch-{plan.epoch}", daemon=True)

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def start(self) -> PlanFetch:
        log.info(
            "plan epoch %d: bringing in %d MiB of windows %s in the background",
            self.epoch,
            (self.needed_bytes - self.held_at_start) >> 20,
            windows_text(self.plan.nodes[self.me].windows),
        )
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Call the fetch off (it stops at its next piece, keeping what it wrote)."""
        self._cancel.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CANCEL_WAIT_S)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def progress(self) -> FetchProgress:
        with self._lock:
            written = sum(self._written_from.values())
            source, error, done = self._source, self._error, self._done
        elapsed = self.clock() - self._t0
        held = min(self.held_at_start + written, self.needed_bytes)
        rate = written / elapsed if written and elapsed > 0 else 0.0
        eta = (self.needed_bytes - held) / rate if rate and not done else 0.0
        return FetchProgress(
            plan_epoch=self.epoch,
            held_bytes=self.needed_bytes if done else held,
            needed_bytes=self.needed_bytes,
            rate_bytes_per_s=rate,
            eta_s=eta,
            source="" if done or error else source,
            error=error,
            done=done,
        )

    def _on_piece(self, address: str, stats: FetchStats) -> None:
        with self._lock:
            self._source = address
            self._written_from[address] = stats.written_bytes

    def _run(self) -> None:
        try:
            needed, missing = self.fetcher.needs(self.gguf, self.plan, self.me)
            with self._lock:
                self.held_at_start = total_bytes(subtract(needed, missing))
            stats = self.fetcher.fetch_missing(
                self.plan,
                self.me,
                missing,
                extra_sources=self.extra_sources,
                on_progress=self._on_piece,
                cancel=self._cancel,
            )
            if self._cancel.is_set():
                return
            self.on_done(stats.written_bytes)
            with self._lock:
                self._done = True
        except FetchCancelled:
            log.info("plan epoch %d: fetch called off", self.epoch)
        except PrimaError as exc:
            log.warning("plan epoch %d: fetch failed: %s", self.epoch, exc)
            with self._lock:
                self._error = str(exc)


def describe_fetch(p: FetchProgress) -> str:
    """A fetch's state for people: Info's status and the error sessions get meanwhile."""
    if p.error:
        return f"fetch for plan epoch {p.plan_epoch} failed: {p.error}"
    gib = 1 << 30
    text = f"fetching its windows for plan epoch {p.plan_epoch}: {p.held_bytes / gib:.2f} of {p.needed_bytes / gib:.2f} GiB"
    if p.source:
        text += f" from {p.source}"
    if p.rate_bytes_per_s:
        text += f", {p.rate_bytes_per_s / (1 << 20):.1f} MiB/s, about {p.eta_s:.0f} s left"
    return text
