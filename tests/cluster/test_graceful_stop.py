"""SIGTERM to a primad of a ring while a generation runs through it: it refuses new sessions
(UNAVAILABLE, saying it is shutting down), lets the generation finish within its
--shutdown-timeout or ends it with an error the coordinator can read, and exits 0."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import GenerationDone
from prima.errors import NodeError
from prima.net.client import NodeClient

from .conftest import ring_request, start_ring

pytestmark = pytest.mark.slow

EXIT_TIMEOUT_S = 120.0  # the deadline plus a bounded wind-up, with room for a busy machine
GENERATION_TIMEOUT_S = 600.0
PROMPT = [1, 2, 3]


def _generate_in_background(
    ring: Ring, max_tokens: int
) -> tuple[threading.Thread, list[object], threading.Event]:
    """Run a generation on `ring` in a thread: its events (and the exception that ended it, if
    one did) land in the list; the event is set once the first token arrives."""
    out: list[object] = []
    first = threading.Event()

    def run() -> None:
        try:
            for event in ring.generate(ring_request(PROMPT, max_tokens)):
                out.append(event)
                first.set()
        except NodeError as exc:
            out.append(exc)
        finally:
            first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out, first


def _wait_until_stopping(client: NodeClient) -> None:
    """Until the daemon has acted on its signal (its Info says so)."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while not client.info().status.startswith("shutting down"):
        assert time.monotonic() < deadline, "the daemon did not start stopping"
        time.sleep(0.05)


@pytest.fixture
def ring_draining_slowly(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(
        2, smollm2_path, ring_logs / "stop-slowly", extra_args=("--shutdown-timeout", "300")
    )


@pytest.fixture
def ring_cutting_at_once(smollm2_path: Path, ring_logs: Path) -> Iterator[LocalRing]:
    yield from start_ring(2, smollm2_path, ring_logs / "stop-at-once", extra_args=("--shutdown-timeout", "0"))


def test_sigterm_lets_the_generation_finish_and_refuses_new_sessions(
    ring_draining_slowly: LocalRing, ring_logs: Path
) -> None:
    ring = Ring.connect(ring_draining_slowly.addresses)
    follower = ring_draining_slowly.procs[1]
    try:
        thread, out, first = _generate_in_background(ring, max_tokens=200)
        assert first.wait(GENERATION_TIMEOUT_S)
        follower.send_signal(signal.SIGTERM)
        # A new session during the drain is refused, and the refusal says why.
        client = NodeClient(ring_draining_slowly.addresses[1])
        try:
            _wait_until_stopping(client)
            with pytest.raises(NodeError, match="node1 is shutting down: it takes no new sessions"):
                client.open_session("late-session", ring.plan.epoch, 64)
        finally:
            client.close()
        thread.join(GENERATION_TIMEOUT_S)
        assert not thread.is_alive()
    finally:
        ring.close()
    # Well within its deadline, the generation ran to its end through the stopping node.
    assert isinstance(out[-1], GenerationDone), out[-1]
    assert len([t for t in out if isinstance(t, int)]) == 200
    assert follower.wait(EXIT_TIMEOUT_S) == 0
    log = (ring_logs / "stop-slowly" / "node1.log").read_text()
    assert "primad: SIGTERM: stopping: 1 session(s) in flight" in log
    assert "primad: stopped: 1 session(s) finished, 0 cut" in log


def test_sigterm_with_no_time_left_ends_the_generation_with_a_clear_error(
    ring_cutting_at_once: LocalRing, ring_logs: Path
) -> None:
    ring = Ring.connect(ring_cutting_at_once.addresses)
    follower = ring_cutting_at_once.procs[1]
    try:
        thread, out, first = _generate_in_background(ring, max_tokens=400)
        assert first.wait(GENERATION_TIMEOUT_S)
        follower.send_signal(signal.SIGTERM)
        thread.join(GENERATION_TIMEOUT_S)
        assert not thread.is_alive()
    finally:
        ring.close()
    end = out[-1]
    assert isinstance(end, NodeError), end
    assert "node1 is shutting down" in str(end)
    assert follower.wait(EXIT_TIMEOUT_S) == 0
    assert (
        "primad: stopped: 0 session(s) finished, 1 cut"
        in (ring_logs / "stop-at-once" / "node1.log").read_text()
    )
