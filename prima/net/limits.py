"""What a daemon accepts from its callers, in numbers, and the checks that hold them to it.

Every limit is answered with a precise status (RESOURCE_EXHAUSTED for a full daemon,
INVALID_ARGUMENT for a malformed value) and a message that quotes at most SHOWN_CHARS of any
string a caller sent, so a hostile caller can neither exhaust the daemon nor make it echo a
megabyte back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from prima.errors import ProtocolError
from prima.net.status import PayloadTooLargeError, StreamTimeoutError

T = TypeVar("T")
SHOWN_CHARS = 64
MAX_MESSAGE_CHARS = 1024  # of a peer's Abort message, passed on to the coordinator
MAX_SESSION_ID_BYTES = 128
MAX_NODE_ID_BYTES = 63
MAX_ADDRESS_BYTES = 255
# Epochs only grow; a jump bigger than this is a broken or hostile coordinator, which could
# otherwise push the epoch to 2**64-1 and leave no newer one for anyone.
MAX_EPOCH_STEP = 1 << 20
MAX_EPOCH = 1 << 53
# The smallest cap on a message a daemon receives: room for a Generate request's prompt (at most
# 5 bytes a token: 800k tokens) and the 1 MiB Ping that measures a link's bandwidth.
MIN_RECEIVED_MESSAGE_BYTES = 4 << 20
# An activation's bytes beyond its hidden states: its other fields, and framing.
ACTIVATION_OVERHEAD_BYTES = 64 << 10


def received_message_bytes(d_model: int, max_batch_tokens: int) -> int:
    """The largest message a daemon of this model needs to receive: a micro-batch of
    `max_batch_tokens` rows of float32 hidden states (the widest wire type) with their positions
    (varints of at most 10 bytes), or MIN_RECEIVED_MESSAGE_BYTES. gRPC refuses a bigger one from
    its length prefix, before the bytes are gathered, so a refused message costs nothing."""
    activation = max_batch_tokens * (d_model * 4 + 10) + ACTIVATION_OVERHEAD_BYTES
    return max(MIN_RECEIVED_MESSAGE_BYTES, activation)


@dataclass(frozen=True)
class DaemonLimits:
    """A daemon's bounds. KV bytes default to a quarter of the machine's memory (set at start)."""

    max_sessions: int = 16
    max_kv_bytes: int = 1 << 30
    # Tokens of activations from peers waiting for the compute thread, all sessions together. A
    # session may queue at most its context's worth: a whole prompt, pipelined, always fits.
    max_queued_tokens: int = 1 << 16
    # Generate calls one caller (certificate name) may have running at once: each holds a server
    # thread and a session, so one caller cannot take them all (`prima serve --parallel` above
    # this needs primad --max-generates).
    max_generates_per_caller: int = 8
    # A Relay stream lives as long as its session; one silent this long, or open this long, is
    # ended (DEADLINE_EXCEEDED), so idle streams cannot hold the daemon's threads.
    relay_idle_s: float = 300.0
    relay_open_s: float = 6 * 3600.0
    # Streams (Relay, Generate, FetchRanges) hold a server thread each for as long as they run;
    # all together may hold this many of the server's threads (prima.net.server.MAX_WORKERS), the
    # rest stay free for control calls (Info, Ping, Profile, Abort, LoadPlan, sessions).
    max_streams: int = 24
    max_fetches_per_caller: int = 4


def shown(text: str) -> str:
    """`text` quoted for an error message, cut to SHOWN_CHARS."""
    return repr(text[:SHOWN_CHARS]) + ("..." if len(text) > SHOWN_CHARS else "")


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise ProtocolError("the session id is empty; give each session a unique id")
    if len(session_id.encode()) > MAX_SESSION_ID_BYTES or not session_id.isprintable():
        raise ProtocolError(f"session id {shown(session_id)} is not 1-{MAX_SESSION_ID_BYTES} printable bytes")


def check_node_id(node_id: str) -> None:
    if not node_id or len(node_id.encode()) > MAX_NODE_ID_BYTES or not node_id.isprintable():
        raise ProtocolError(f"node id {shown(node_id)} is not 1-{MAX_NODE_ID_BYTES} printable bytes")


def check_address(address: str) -> None:
    """A peer address must be host:port (no unix: sockets or other gRPC schemes): a daemon only
    dials network peers."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    ok = (
        bool(sep and bare)
        and len(address) <= MAX_ADDRESS_BYTES
        and port.isdigit()
        and 0 < int(port) < 65536
        and "/" not in address
        and (bracketed or ":" not in bare)
        and bare.isprintable()
    )
    if not ok:
        raise ProtocolError(f"address {shown(address)} is not host:port")


def check_epoch(epoch: int, current: int | None) -> None:
    """A plan's epoch: positive, and no lower than (nor far beyond) the epoch loaded now."""
    if not 0 < epoch <= MAX_EPOCH:
        raise ProtocolError(f"plan epoch {epoch} is outside [1, 2**53]")
    if current is not None and epoch > current + MAX_EPOCH_STEP:
        raise ProtocolError(
            f"plan epoch {epoch} jumps more than {MAX_EPOCH_STEP} past the loaded epoch {current}; "
            "use the loaded epoch + 1"
        )


class WorkBounds:
    """Counts the tokens queued for the compute thread, in all and per session."""

    def __init__(self, limits: DaemonLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._total = 0
        self._per_session: Counter[str] = Counter()

    def admit(self, session_id: str, tokens: int, session_cap: int) -> None:
        """Count `tokens` more queued tokens of a session that may queue `session_cap` (its
        context), or PayloadTooLargeError if a bound is reached."""
        with self._lock:
            if self._total + tokens > self.limits.max_queued_tokens:
                raise PayloadTooLargeError(
                    f"{self._total} tokens of activations are already queued on this node; send more slowly"
                )
            if self._per_session[session_id] + tokens > session_cap:
                raise PayloadTooLargeError(
                    f"session {shown(session_id)} already has {self._per_session[session_id]} tokens queued "
                    f"here, and its context holds {session_cap}; wait for results before sending more"
                )
            self._total += tokens
            self._per_session[session_id] += tokens

    def done(self, session_id: str, tokens: int) -> None:
        with self._lock:
            taken = min(tokens, self._per_session[session_id])
            self._total -= taken
            self._per_session[session_id] -= taken
            if self._per_session[session_id] <= 0:
                del self._per_session[session_id]


class StreamBudget:
    """The server threads all streams together may hold (DaemonLimits.max_streams)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.running = 0

    def take(self, what: str) -> None:
        with self._lock:
            if self.running >= self.limit:
                raise PayloadTooLargeError(
                    f"this node already serves {self.running} streams, the most it keeps threads for; "
                    f"the {what} call may be retried when one ends"
                )
            self.running += 1

    def give_back(self) -> None:
        with self._lock:
            self.running -= 1


class CallerSlots:
    """Counts the calls each caller has running, up to `limit` at once, each also taking a place
    of `budget` when one is given (streams of several kinds share one)."""

    def __init__(self, limit: int, what: str, budget: StreamBudget | None = None) -> None:
        self.limit = limit
        self.what = what
        self.budget = budget
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    def take(self, caller: str) -> None:
        """One more call of `caller`, or PayloadTooLargeError naming the limit."""
        with self._lock:
            if self._running[caller] >= self.limit:
                raise PayloadTooLargeError(
                    f"{shown(caller)} already has {self._running[caller]} {self.what} calls running on this "
                    f"node, the most one caller may; wait for one to finish"
                )
            if self.budget is not None:
                self.budget.take(self.what)
            self._running[caller] += 1

    def give_back(self, caller: str) -> None:
        with self._lock:
            self._running[caller] -= 1
            if self._running[caller] <= 0:
                del self._running[caller]
            if self.budget is not None:
                self.budget.give_back()


def consume_bounded(
    messages: Iterator[T],
    handle: Callable[[T], None],
    idle_s: float,
    open_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Pass each message of `messages` (a client stream) to `handle`, in order, as long as each
    arrives within `idle_s` of the last and the stream is open under `open_s`; else raise
    StreamTimeoutError. An error of the stream or of `handle` ends it and is raised here.

    gRPC's iterator cannot wait with a timeout, so a reader thread takes the messages and hands
    each straight to `handle`, while the calling thread only watches the clock: a message costs
    no hand-over between threads (one wake-up less per hop of the ring). The reader handles one
    message at a time, which keeps the client's flow control."""
    last = [clock()]
    closes_at = last[0] + open_s
    done = threading.Event()
    stopped = threading.Event()  # the watcher gave up: the reader handles nothing more
    failure: list[BaseException] = []

    def read() -> None:
        try:
            for m in messages:
                if stopped.is_set():
                    return
                last[0] = clock()
                handle(m)
        except Exception as exc:  # raised again by the watching thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=read, name="relay-reader", daemon=True).start()
    try:
        while not done.is_set():
            now = clock()
            if now >= closes_at:
                raise StreamTimeoutError(
                    f"this stream has been open {open_s:g} s, the most a node allows; open a new one"
                )
            if now - last[0] >= idle_s:
                raise StreamTimeoutError(
                    f"no message on this stream for {idle_s:g} s; a node ends idle streams (open one per "
                    "session and close it when the session ends)"
                )
            done.wait(max(0.0, min(closes_at, last[0] + idle_s) - now))
    finally:
        stopped.set()
    if failure:
        raise failure[0]
