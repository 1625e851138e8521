"""A member flooding a daemon with the longest micro-batches it accepts does not stop another
session's generation: the daemon (its own process, a one-node ring on 127.0.0.1) computes each
layer of the flood in pieces of its rows and serves the other session's steps between pieces,
and the generation beside the flood gives the tokens it gives alone. Its time beside the flood
and alone are measured and printed, never asserted (docs/security.md records them;
`python -m tests.cluster.flood_fairness` measures more)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.daemon.runtime import DEFAULT_MAX_BATCH_TOKENS
from prima.net.proto import prima_pb2_grpc as pb_grpc
from tests.cluster.flood_fairness import generate, generation_beside_flood, start_daemon

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(smollm2_path: Path) -> Iterator[pb_grpc.NodeStub]:
    ring, channel, stub = start_daemon(str(smollm2_path))
    try:
        yield stub
    finally:
        channel.close()
        ring.close()


def test_a_generation_beside_a_flood_of_long_batches_gives_its_tokens(daemon: pb_grpc.NodeStub) -> None:
    generate(daemon, 1)  # pages the weights in and compiles: not part of the solo time
    alone, beside, result = generation_beside_flood(daemon, DEFAULT_MAX_BATCH_TOKENS)
    assert result.refused >= 1  # the flood was queued past its bound while the generation ran
    assert beside == alone
    print(  # noqa: T201 - a measurement for the record, not a check
        f"generation of {len(alone)} tokens: alone {result.solo_s:.2f} s, beside a flood of "
        f"{DEFAULT_MAX_BATCH_TOKENS}-token batches {result.beside_s:.2f} s "
        f"({result.beside_s / result.solo_s:.1f}x)"
    )
