"""Drafting while a ring checks the last drafts (pipelined speculative decoding).

On a ring, a pass that checks drafts waits for a trip round it: the other nodes' compute and a
few milliseconds a hop on Wi-Fi, during which the head's CPU is idle. The head's drafter uses
that wait to guess on: what follows the drafts being checked, first the token the check will
sample after them, then the next drafts. If the check keeps every draft and samples that first
guess, the next pass's drafts are already there and drafting costs no time; otherwise they are
dropped and drafted again, as without this. The output never depends on it: the check decides
every token (generate.sample_tokens).

Only with a draft model, and only where the check waits on the network (an engine with
`checks_over_network`): on one device the draft model and the check would share the same cores,
and the guesses would take them from it. Prompt lookup costs nothing to run when its drafts are
needed, and it indexes every context it sees as final, which a guessed one is not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from prima.engine.draft_choice import model_drafter
from prima.engine.speculative import DraftConfig, Drafter


def checks_over_network(engine: object) -> bool:
    """Whether `engine` checks drafts by a trip round a ring (it says so), so that drafting
    ahead overlaps a wait rather than compute."""
    return bool(getattr(engine, "checks_over_network", False))


def drafts_ahead(drafts_from: Drafter | None, draft: DraftConfig, engine: object) -> DraftsAhead | None:
    """What drafts ahead for a generation: a DraftsAhead for a draft model on an engine that
    checks over the network, else None (draft when a pass needs it)."""
    if drafts_from is None or draft.method != "model" or not checks_over_network(engine):
        return None
    return DraftsAhead(model_drafter(drafts_from), draft.max_tokens)


class DraftsAhead:
    """The drafts guessed during the last check, and what they assumed of it."""

    def __init__(self, drafts_from: Drafter, max_drafts: int) -> None:
        self.drafts_from = drafts_from
        self.max_drafts = max_drafts
        self._context: list[int] = []  # the context the guesses follow (history + drafts)
        self._guesses: list[int] = []  # its next token, then the drafts after that

    def check(
        self, forward_all: Callable[[list[int]], np.ndarray], history: Sequence[int], drafts: list[int]
    ) -> np.ndarray:
        """forward_all([history[-1], *drafts]) (the check), on a thread of its own while this one
        guesses what follows the drafts; the check's logits."""
        result: list[np.ndarray] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.append(forward_all([history[-1], *drafts]))
            except BaseException as exc:  # re-raised on the caller's thread below
                failure.append(exc)

        worker = threading.Thread(target=run, name="prima-draft-check", daemon=True)
        worker.start()
        try:
            self._context = [*history, *drafts]
            # The sampled token after the drafts, then as many drafts as the next pass may take.
            self._guesses = self.drafts_from.propose(self._context, 1 + min(self.max_drafts, len(drafts) + 1))
        finally:
            worker.join()
        if failure:
            raise failure[0]
        return result[0]

    def take(self, history: Sequence[int], n_tokens: int) -> list[int]:
        """Up to `n_tokens` drafts guessed during the last check, if it kept every draft and
        sampled the guessed token after them (history is then that context and that token);
        else [] (draft again). Each guess is used once."""
        guesses, context = self._guesses, self._context
        self._guesses, self._context = [], []
        if n_tokens <= 0 or len(guesses) < 2 or len(history) != len(context) + 1:
            return []
        if history[-1] != guesses[0] or list(history[:-1]) != context:
            return []
        return guesses[1 : 1 + n_tokens]
