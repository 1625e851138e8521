"""A ring head's sessions kept open after their generation ends, so the next request that starts
with what one holds (a chat's next turn, a shared system prompt) sends only the rest round the
ring. Every node keeps its KV cache for a kept session; positions travel with the activations,
so a request that keeps only a prefix needs no message: its first batch writes over the rest.

Bounded three ways: at most `limit` sessions; each closed after `idle_s` unused (a thread wakes
for the oldest); all closed when the node stops taking work, or when a new session finds no room
on some node (Head._open_engine). A kept session a node lost meanwhile (restarted, cut, a new
plan) fails its next request before any token, which then runs on a new session from the start
(Head.generate): callers never see the difference but in `cached_tokens`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from prima.engine.prefix import choose_held
from prima.plan import Plan

log = logging.getLogger("prima.daemon")

DEFAULT_IDLE_S = 300.0  # how long an unused kept session holds every node's KV memory
DEFAULT_KEPT_SESSIONS = 4  # primad --keep-sessions: a few chats, each within the KV bounds


class KeptSession(Protocol):
    """What is read of a kept ring session (prima.daemon.head.RingEngine, whose head keeps them):
    its id, the plan and context it was opened for, and the tokens the nodes' caches hold."""

    session_id: str
    plan: Plan
    n_ctx: int

    @property
    def held_tokens(self) -> tuple[int, ...]: ...


Engine = TypeVar("Engine", bound=KeptSession)


@dataclass
class _Kept(Generic[Engine]):
    engine: Engine
    since: float  # clock() when its last generation ended


class KeptSessions(Generic[Engine]):
    """Up to `limit` idle ring sessions, least recently used first; `close` ends one on every
    node. `clock` is injectable (seconds, monotonic)."""

    def __init__(
        self,
        limit: int,
        close: Callable[[Engine], None],
        idle_s: float = DEFAULT_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 0 or idle_s <= 0:
            raise ValueError(f"kept sessions need limit >= 0 and idle_s > 0, got {limit}, {idle_s}")
        self.limit = limit
        self.idle_s = idle_s
        self._close = close
        self._clock = clock
        self._cv = threading.Condition()
        self._kept: list[_Kept[Engine]] = []
        self._reaper: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, prompt: Sequence[int], epoch: int, n_ctx: int) -> Engine | None:
        """The kept session of plan `epoch` and context `n_ctx` that `prompt` should continue
        (prima.engine.prefix.choose_held), no longer kept; None: open a new one."""
        self.expire()
        with self._cv:
            stale = [k for k in self._kept if k.engine.plan.epoch != epoch]
            self._kept = [k for k in self._kept if k not in stale]
            fits = [k for k in self._kept if k.engine.n_ctx == n_ctx]
            chosen = choose_held([k.engine.held_tokens for k in fits], prompt, len(self._kept) < self.limit)
            taken = fits[chosen] if chosen is not None else None
            if taken is not None:
                self._kept.remove(taken)
        self._end(stale, "a new plan")
        return taken.engine if taken is not None else None

    def keep(self, engine: Engine) -> None:
        """Keep `engine` (its generation ended well) for the next request; past `limit`, the
        one used least recently is closed."""
        if self.limit == 0:
            self._end([_Kept(engine, 0.0)], "no sessions are kept")
            return
        with self._cv:
            self._kept.append(_Kept(engine, self._clock()))
            over = self._kept[: max(0, len(self._kept) - self.limit)]
            del self._kept[: len(over)]
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="primad-kept-sessions", daemon=True)
                self._reaper.start()
            self._cv.notify_all()
        self._end(over, f"more than {self.limit} kept")

    def expire(self) -> int:
        """Close the sessions unused for `idle_s`; how many."""
        now = self._clock()
        with self._cv:
            old = [k for k in self._kept if now - k.since >= self.idle_s]
            self._kept = [k for k in self._kept if k not in old]
        self._end(old, f"idle for {self.idle_s:g} s")
        return len(old)

    def release_all(self) -> int:
        """Close every kept session (the node stops, or a new session needs the room); how many."""
        with self._cv:
            taken, self._kept = self._kept, []
            self._cv.notify_all()
        self._end(taken, "released")
        return len(taken)

    def _end(self, kept: list[_Kept[Engine]], why: str) -> None:
        for k in kept:
            log.debug("closing kept session %s: %s", k.engine.session_id, why)
            self._close(k.engine)

    def _reap(self) -> None:
        """Wake when the oldest kept session's idle time is up, while any is kept."""
        while True:
            with self._cv:
                if not self._kept:
                    self._reaper = None
                    return
                wait = min(k.since for k in self._kept) + self.idle_s - self._clock()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
            self.expire()
