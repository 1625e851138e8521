"""The plan a daemon runs, as its Layout: taken on at LoadPlan, or, when the model file holds
only part of the model, once a background fetch (prima.daemon.fetching) has brought in the
bytes of its windows. A new plan ends every session of the one before."""

from __future__ import annotations

import logging
import threading

from prima.forward.loader import LoadedModel
from prima.net.client import Transport
from prima.net.codec import WireDType
from prima.net.status import NotReadyError
from prima.plan import Plan, windows_text
from prima.weights.window import Residency

from .authorization import PlanOwnership
from .fetching import PlanFetch, WindowFetcher, describe_fetch
from .install import build_layout, check_plan
from .sessions import Sessions, end_sessions
from .state import Layout

log = logging.getLogger("prima.daemon")


class PlanHolder:
    """Node `node_id`'s current Layout (None before a plan), the fetch of a plan still being
    brought in, and who loaded the plan. `budget_bytes` None measures the layers' budget at
    each plan load (auto); `fetcher` brings in what a partial model file lacks."""

    def __init__(
        self,
        loaded: LoadedModel,
        sessions: Sessions,
        fetcher: WindowFetcher,
        node_id: str,
        *,
        budget_bytes: int | None = None,
        identity: Transport = None,
    ) -> None:
        self.loaded = loaded
        self.sessions = sessions
        self.fetcher = fetcher
        self.node_id = node_id  # for messages; primad names its node once it has a port
        self.budget_bytes = budget_bytes
        self.identity = identity  # how this node calls its peers (see NodeClient)
        self._lock = threading.Lock()
        self._layout: Layout | None = None
        self._fetch: PlanFetch | None = None  # the latest plan's background fetch, if it needed one
        self._ownership: PlanOwnership | None = None  # who loaded the plan (its certificate's name)

    @property
    def layout(self) -> Layout | None:
        return self._layout

    @property
    def fetch(self) -> PlanFetch | None:
        """The latest plan's background fetch, if it needed one (kept once done, for Info)."""
        return self._fetch

    @property
    def ownership(self) -> PlanOwnership | None:
        """The installed plan and who loaded it; None before a plan is installed."""
        ownership = self._ownership
        return ownership if self._layout is not None else None

    def need_layout(self) -> Layout:
        """The current Layout; NotReadyError saying what the node waits for when it has none."""
        layout = self._layout
        if layout is None:
            fetch = self._fetch
            if fetch is not None:
                raise NotReadyError(
                    f"node {self.node_id} is not ready: {describe_fetch(fetch.progress())}; "
                    "wait until its Info says ready"
                )
            raise NotReadyError(f"node {self.node_id} has no plan yet; send LoadPlan first")
        return layout

    @property
    def plan(self) -> Plan:
        return self.need_layout().plan

    def residency(self) -> Residency | None:
        """What the current plan's layers hold in memory, None before a plan."""
        layout = self._layout
        return layout.windows.residency() if layout else None

    def load_plan(
        self,
        plan: Plan,
        node_id: str,
        wire_dtype: WireDType,
        owner: str | None = None,
        fetch_sources: tuple[str, ...] = (),
    ) -> None:
        """Take on this node's windows of `plan`; drops every session of the previous plan.
        A node holding only part of its model loads the plan once it has fetched (in the
        background, also from `fetch_sources`) the bytes of its windows. The same plan sent
        again while it is fetched (a retried call) lets that fetch go on."""
        self.sessions.check_not_stopping("plan")
        me = check_plan(plan, node_id, self.loaded, self._current_epoch(), fetch_sources)
        pending = self._fetch
        if pending is not None and pending.plan == plan and pending.me == me and not pending.progress().error:
            return
        self.cancel_fetch()
        if self.fetcher.store.partial:
            self._start_fetch(plan, me, wire_dtype, owner, fetch_sources)
            return
        self._install(plan, me, wire_dtype, owner)

    def cancel_fetch(self) -> None:
        """Call off the running fetch, if any (a newer plan, or the daemon shutting down)."""
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            fetch.cancel()

    def _current_epoch(self) -> int | None:
        """The epoch of the loaded plan, or of the plan being fetched if newer."""
        epochs = [x.plan.epoch for x in (self._layout, self._fetch) if x is not None]
        return max(epochs) if epochs else None

    def _start_fetch(
        self, plan: Plan, me: int, wire_dtype: WireDType, owner: str | None, sources: tuple[str, ...]
    ) -> None:
        """Drop the previous plan (its sessions end, as with any new plan) and fetch this one's
        windows in the background; the fetch loads the plan when it holds them."""
        fetch = PlanFetch(
            self.fetcher,
            self.loaded.gguf,
            plan,
            me,
            on_done=lambda written: self._install(plan, me, wire_dtype, owner, written, fetch),
            extra_sources=sources,
        )
        with self._lock:
            sessions = self.sessions.take_all()
            old, self._layout = self._layout, None
            self._ownership = PlanOwnership(plan, owner)
            self._fetch = fetch
        end_sessions(sessions, f"node {self.node_id} is fetching the windows of plan epoch {plan.epoch}")
        if old:
            old.close()
        fetch.start()

    def _install(
        self,
        plan: Plan,
        me: int,
        wire_dtype: WireDType,
        owner: str | None,
        fetched_bytes: int = 0,
        fetch: PlanFetch | None = None,
    ) -> None:
        """Load node `me`'s windows of `plan`, whose bytes it holds, in place of the plan before
        (whose sessions end), unless a newer LoadPlan replaced it while it was fetched."""
        layout, keep = build_layout(
            self.loaded,
            plan,
            me,
            wire_dtype,
            node_id=self.node_id,
            budget_bytes=self.budget_bytes,
            identity=self.identity,
            fetched=bool(fetched_bytes),
        )
        with self._lock:
            stale = fetch is not None and (self._fetch is not fetch or fetch.cancelled)
            if not stale:
                # Taken before the layout changes: a session opened for the new plan stays.
                sessions = self.sessions.take_all()
                old, self._layout = self._layout, layout
                self._ownership = PlanOwnership(plan, owner)
        if stale:
            layout.close()
            return
        end_sessions(sessions, f"node {self.node_id} loaded plan epoch {plan.epoch}")
        self.loaded.model.release_windows(keep=keep)
        if old:
            old.close()
        windows = plan.nodes[me].windows
        log.info(
            "node %s: plan epoch %d, windows %s",
            plan.nodes[me].node_id,
            plan.epoch,
            windows_text(windows),
        )
