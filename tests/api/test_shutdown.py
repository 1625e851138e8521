"""The graceful stop's bookkeeping: requests count themselves in and out, the stop remembers how
many were in flight when it began, and drain cuts what is left at the deadline (or at once on a
second signal) and reports how each ended. No sockets: the server here is the Stoppable protocol's
parts, with requests held open by the test."""

from __future__ import annotations

import threading
from contextlib import ExitStack

from prima.api.shutdown import InFlight, StopReport, drain


class Server:
    """Holds `n` requests open until cut_generations ends them (each marked cut)."""

    def __init__(self, n: int) -> None:
        self.in_flight = InFlight()
        self.requests = ExitStack()
        for _ in range(n):
            self.requests.enter_context(self.in_flight.track())
        self.taking_work = True
        self.cuts = 0

    def stop_taking_work(self) -> int:
        self.taking_work = False
        return self.in_flight.begin_stop()

    def cut_generations(self) -> None:
        self.cuts += 1
        for _ in range(self.in_flight.active):
            self.in_flight.mark_cut()
        self.requests.close()


def test_requests_count_themselves_in_and_out() -> None:
    flight = InFlight()
    with flight.track(), flight.track():
        assert flight.active == 2
        assert not flight.wait_idle(0.0)
    assert flight.active == 0
    assert flight.wait_idle(0.0)


def test_the_stop_counts_the_requests_in_flight_when_it_began() -> None:
    flight = InFlight()
    with flight.track():
        assert flight.begin_stop() == 1
        with flight.track():  # begun after the stop: refused in the server, not counted here
            assert flight.begin_stop() == 1
    assert flight.report() == StopReport(in_flight=1, finished=1, cut=0)


def test_an_idle_server_drains_at_once() -> None:
    server = Server(0)
    assert drain(server, timeout_s=30.0) == StopReport(0, 0, 0)
    assert not server.taking_work
    assert server.cuts == 0


def test_requests_left_at_the_deadline_are_cut() -> None:
    server = Server(2)
    assert drain(server, timeout_s=0.0) == StopReport(in_flight=2, finished=0, cut=2)
    assert server.cuts == 1
    assert server.in_flight.active == 0


def test_a_second_signal_cuts_without_waiting_for_the_deadline() -> None:
    server = Server(1)
    now = threading.Event()
    now.set()
    assert drain(server, timeout_s=3600.0, now=now) == StopReport(in_flight=1, finished=0, cut=1)
