"""One line per stage of a slow start (fetching, compiling kernels, starting daemons, planning) on
stderr, so that a first run says what it is doing instead of sitting silent for minutes."""

from __future__ import annotations

import sys

from tqdm import tqdm

from prima.coordinator.readiness import RingFetch


def stage(message: str, prog: str = "prima") -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


class FetchBar:
    """A tqdm bar on stderr of the bytes a ring's nodes fetch before they take a plan on (the
    coordinator's on_fetch); it opens at the first report, so a ring that fetches nothing
    shows nothing."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None

    def __call__(self, fetch: RingFetch) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=fetch.needed_bytes,
                unit="B",
                unit_scale=True,
                desc="prima: nodes fetching",
                file=sys.stderr,
            )
        self._bar.total = fetch.needed_bytes
        self._bar.n = fetch.held_bytes
        names = ", ".join(f"{n} from {p.source or '?'}" for n, p in fetch.nodes)
        self._bar.set_postfix_str(f"{names}; ready in ~{fetch.eta_s:.0f} s", refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
