"""A member's fuzz of a primad process over mutual TLS (tests/net/member_fuzz.py): no UNKNOWN or
INTERNAL status, no call left hanging, no silent OK for a message the protocol forbids, the
daemon alive with its resident set sampled, and a normal generation afterwards equal to the
one before. A CI-sized count here; `python -m tests.net.member_fuzz --calls 10000` runs the full
count (docs/security.md has its numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.net.proto import prima_pb2 as pb
from tests.net import member_fuzz

pytestmark = pytest.mark.slow

CALLS = 400
SEED = 38
RSS_GROWTH_KIB = 256 << 10  # over 400 calls; the script's 10,000 measure the trend


def test_a_members_fuzzed_calls_get_precise_statuses_and_the_daemon_serves_on(smollm2_path: Path) -> None:
    ring, channel, stub = member_fuzz.start_daemon(smollm2_path)
    try:
        member_fuzz.load_plan(stub, ring, 1)
        before = member_fuzz.generate(stub)
        report = member_fuzz.fuzz(ring, stub, CALLS, SEED, deadline_s=600)
        assert report.exited is None
        assert sum(report.codes.values()) == CALLS
        assert not report.wrong, "\n".join(report.wrong[:20])
        assert report.rss_kib[-1] - report.rss_kib[0] <= RSS_GROWTH_KIB, report.rss_kib
        epoch = stub.Info(pb.InfoRequest(), timeout=member_fuzz.CALL_S).plan_epoch + 1
        member_fuzz.load_plan(stub, ring, epoch)
        assert member_fuzz.generate(stub) == before
    finally:
        channel.close()
        ring.close()
