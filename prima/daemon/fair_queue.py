"""The compute thread's queue: each session's activations in the order they came, the sessions
served in turn.

With one first-come queue, a member that relays a burst of long micro-batches makes every other
session's next step wait for the whole burst; taking sessions in turn, another session waits for
at most one micro-batch of each busy session ahead of it. Within a session, order is kept: its
micro-batches reach each layer in the order they were sent, so its KV cache is written front to
back.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Generic, Protocol, TypeVar


class HasSession(Protocol):
    @property
    def session_id(self) -> str: ...


T = TypeVar("T", bound=HasSession)


class FairQueue(Generic[T]):
    """A blocking queue of items with a `session_id`, round-robin between sessions, FIFO within
    one. `stop()` makes `get` return None once every item queued before it is served."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._sessions: collections.OrderedDict[str, collections.deque[T]] = collections.OrderedDict()
        self._size = 0
        self._stopping = False

    def put(self, item: T) -> None:
        with self._cv:
            self._sessions.setdefault(item.session_id, collections.deque()).append(item)
            self._size += 1
            self._cv.notify()

    def put_first(self, item: T) -> None:
        """Queue `item` ahead of its session's others (the rest of a micro-batch that gave up
        its turn part-way); its session takes its next turn after every other waiting one."""
        with self._cv:
            items = self._sessions.pop(item.session_id, collections.deque())
            items.appendleft(item)
            self._sessions[item.session_id] = items
            self._size += 1
            self._cv.notify()

    def others_waiting(self, session_id: str) -> bool:
        """Whether a session other than `session_id` has an item queued."""
        with self._cv:
            return any(sid != session_id for sid in self._sessions)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def get(self) -> T | None:
        """The next item (blocking), or None once stopped and empty."""
        with self._cv:
            while not self._size and not self._stopping:
                self._cv.wait()
            return self._take() if self._size else None

    def get_nowait(self) -> T:
        """The next item, or queue.Empty."""
        with self._cv:
            if not self._size:
                raise queue.Empty
            return self._take()

    def qsize(self) -> int:
        return self._size

    def _take(self) -> T:
        """The oldest item of the session whose turn it is; that session then goes to the back."""
        session_id, items = next(iter(self._sessions.items()))
        item = items.popleft()
        self._size -= 1
        if items:
            self._sessions.move_to_end(session_id)
        else:
            del self._sessions[session_id]
        return item
