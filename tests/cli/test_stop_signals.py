"""SIGTERM and SIGINT as a graceful stop: the first signal asks (and is named), the next says now.
Real signals, sent to this process; the handlers pytest had are put back."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator

import pytest

from prima.cli.stop_signals import DEFAULT_SHUTDOWN_TIMEOUT_S, SIGNALS, StopSignals, add_shutdown_timeout_arg


@pytest.fixture
def stop() -> Iterator[StopSignals]:
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield StopSignals()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_the_first_signal_asks_and_is_named(stop: StopSignals) -> None:
    assert not stop.requested.is_set()
    signal.raise_signal(signal.SIGTERM)
    assert stop.wait() == "SIGTERM"
    assert not stop.now.is_set()


def test_a_second_signal_says_stop_now(stop: StopSignals) -> None:
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGTERM)
    assert stop.signal == "SIGINT"  # the first one's name stays
    assert stop.now.is_set()


def test_the_shutdown_timeout_flag() -> None:
    p = argparse.ArgumentParser()
    add_shutdown_timeout_arg(p, "generations")
    assert p.parse_args([]).shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT_S
    assert p.parse_args(["--shutdown-timeout", "0"]).shutdown_timeout == 0.0
    with pytest.raises(SystemExit):
        p.parse_args(["--shutdown-timeout", "-1"])
