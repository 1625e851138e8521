"""What a LinkRelay reports through on_error, for tests that end links on purpose."""

from __future__ import annotations

import threading

from prima.errors import NodeError


class Errors:
    """The errors a LinkRelay reported, waited for with a bound."""

    def __init__(self) -> None:
        self.got: list[NodeError] = []
        self.event = threading.Event()

    def __call__(self, err: NodeError) -> None:
        self.got.append(err)
        self.event.set()

    def wait(self) -> str:
        """The first error's message, once one came (10 s at most)."""
        assert self.event.wait(10), "the link never reported why it ended"
        return str(self.got[0])
