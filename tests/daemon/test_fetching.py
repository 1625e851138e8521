"""A fetch's state for people (prima.daemon.fetching.describe_fetch), as Info's status and
not-ready errors say it: how much of how much, from whom, how fast; or why it failed. The
fetch itself is tested over real gRPC in daemon/test_background_fetch.py and net/test_fetch.py."""

from __future__ import annotations

from prima.daemon.fetching import describe_fetch
from prima.net.node_status import FetchProgress

GiB = 1 << 30
MiB = 1 << 20


def test_a_fetch_under_way_says_how_far_from_whom_and_how_fast() -> None:
    progress = FetchProgress(
        plan_epoch=4,
        held_bytes=GiB // 2,
        needed_bytes=2 * GiB,
        rate_bytes_per_s=12.5 * MiB,
        eta_s=122.9,
        source="10.0.0.2:7600",
    )
    assert describe_fetch(progress) == (
        "fetching its windows for plan epoch 4: 0.50 of 2.00 GiB from 10.0.0.2:7600, 12.5 MiB/s, about 123 s left"
    )


def test_a_fetch_before_its_first_piece_names_no_source_or_rate() -> None:
    progress = FetchProgress(plan_epoch=1, held_bytes=0, needed_bytes=3 * GiB // 4)
    assert describe_fetch(progress) == "fetching its windows for plan epoch 1: 0.00 of 0.75 GiB"


def test_a_failed_fetch_says_why() -> None:
    progress = FetchProgress(
        plan_epoch=2, held_bytes=GiB, needed_bytes=2 * GiB, source="a:1", error="no peer could send it"
    )
    assert describe_fetch(progress) == "fetch for plan epoch 2 failed: no peer could send it"
