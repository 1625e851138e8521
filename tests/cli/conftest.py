"""Commands run in-process through prima.cli.main.main, which installs its own SIGTERM handler:
each test gets pytest's back."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_sigterm() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
