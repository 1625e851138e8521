"""Where a node without the model file gets its bytes, with real daemons: when its source has gone
the coordinator's wait names the node and the fix while the daemon keeps serving; a coordinator
holding the file then serves it to the ring itself (over the ring's mutual TLS), and the node
computes exactly the single-device tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.errors import NodeError
from prima.forward.loader import load_model
from prima.model.byte_ranges import needed_ranges, total_bytes
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net.client import NodeClient
from prima.net.discovery import Advertiser
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES
from prima.net.node_adverts import NodeAdvert
from prima.net.server import start_server

from .conftest import reference_tokens, ring_tokens

pytestmark = pytest.mark.slow


def test_a_gone_source_is_named_and_the_coordinator_serves_the_file(
    smollm2_path: Path, oracle: Callable[[str], dict[str, Any]], tmp_path: Path
) -> None:
    model = smollm2_path
    prompt = oracle("smollm2-135m")["prompts"][0]["prompt_token_ids"]
    expected = reference_tokens(model, prompt)
    stops = sorted(load_model(model, layers=range(0)).tokenizer.stop_ids)
    part = tmp_path / "node1" / "model.gguf"
    logs = tmp_path / "logs"
    with LocalRing.start(1, model, threads=1, log_dir=logs / "holder", extra_args=("--exact",)) as holder:
        follower = LocalRing.start(
            1,
            model,
            models=[part],
            names=["node1"],
            threads=1,
            log_dir=logs / "follower",
            extra_args=("--exact", "--fetch-from", holder.addresses[0]),
        )
    with follower:  # the holder has stopped: node1 holds the header only
        with pytest.raises(NodeError, match=r"node node1 .* could not fetch its windows .*--fetch-from"):
            Ring.connect(follower.addresses)
        client = NodeClient(follower.addresses[0])
        try:
            status = client.info()  # still serving, and saying what went wrong
        finally:
            client.close()
        assert not status.healthy
        assert "failed" in status.status
        assert not status.holds_full_file
        ring = Ring.connect(follower.addresses, serve_file=model)
        try:
            assert ring.file_source is not None
            assert ring_tokens(ring, prompt, stop_ids=stops) == expected
            windows = ring.plan.nodes[0].windows
        finally:
            ring.close()
    with GGUFFile(model) as gguf:
        assert SparseFile.open(part).held_bytes() == total_bytes(needed_ranges(gguf, windows, head=True))


def test_a_node_finds_a_daemon_holding_the_file_over_mdns(
    mdns_env: None, smollm2_path: Path, tmp_path: Path
) -> None:
    """`primad --fetch-from mdns`: the holder advertises full=1; the joining node fetches its
    header from it with no address given."""
    part = tmp_path / "node1" / "model.gguf"
    logs = tmp_path / "logs"
    with GGUFFile(smollm2_path) as gguf:
        fingerprint = gguf.fingerprint()
    with (
        LocalRing.start(1, smollm2_path, threads=1, log_dir=logs / "holder", mdns=True),
        LocalRing.start(
            1,
            smollm2_path,
            models=[part],
            names=["node1"],
            threads=1,
            log_dir=logs / "follower",
            extra_args=("--fetch-from", "mdns"),
        ) as follower,
    ):
        client = NodeClient(follower.addresses[0])
        try:
            status = client.info()
        finally:
            client.close()
    assert status.model_fingerprint == fingerprint
    assert not status.holds_full_file
    assert 0 < SparseFile.open(part).held_bytes() < smollm2_path.stat().st_size // 10


def test_a_node_skips_a_rogue_holder_and_waits_for_the_real_one(
    mdns_env: None, smollm2_path: Path, tmp_path: Path
) -> None:
    """`primad --fetch-from mdns` started before any member holds the file, while a plaintext
    rogue advertises full=1 (tried first: its id sorts first): the node skips the rogue with a
    line, waits with a progress line, and fetches from the real holder once it is up."""
    part = tmp_path / "node1" / "model.gguf"
    logs = tmp_path / "logs"
    with GGUFFile(smollm2_path) as gguf:
        fingerprint = gguf.fingerprint()
    rogue, rogue_port = start_server(object(), "127.0.0.1", 0, MIN_RECEIVED_MESSAGE_BYTES)  # type: ignore[arg-type]  # plaintext
    advert = NodeAdvert("a-rogue", "127.0.0.1", rogue_port, fingerprint, "m", holds_full_file=True)
    with Advertiser(advert, interfaces="127.0.0.1"), ThreadPoolExecutor(1) as pool:
        starting = pool.submit(
            LocalRing.start,
            1,
            smollm2_path,
            models=[part],
            names=["node1"],
            threads=1,
            log_dir=logs / "follower",
            extra_args=("--fetch-from", "mdns", "--fetch-wait", "120"),
        )
        try:
            follower_log = logs / "follower" / "node0.log"
            assert _wait_for_line(follower_log, f"skipping 127.0.0.1:{rogue_port}", starting)
            with LocalRing.start(1, smollm2_path, threads=1, log_dir=logs / "holder", mdns=True):
                with starting.result(timeout=120) as follower:
                    client = NodeClient(follower.addresses[0])
                    try:
                        status = client.info()
                    finally:
                        client.close()
                    log = follower_log.read_text()
        finally:
            rogue.stop(grace=None)
    assert status.model_fingerprint == fingerprint
    assert log.count(f"skipping 127.0.0.1:{rogue_port}") == 1
    assert "not a member of this cluster" in log
    assert 0 < SparseFile.open(part).held_bytes() < smollm2_path.stat().st_size // 10


def _wait_for_line(path: Path, text: str, starting: Future[LocalRing], timeout_s: float = 60.0) -> bool:
    """Whether `text` shows in the log at `path` within `timeout_s` (False at once if the daemon
    ended first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not starting.done():
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.2)
    return False
