"""A follower that fetches its layers under `primad --disk-budget`: its profile says what it holds
and may hold, a plan past the budget is refused with a clear error (and the daemon serves on),
and Halda's plan for the same daemons stays within it."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.planner import ClusterView, HaldaOptions
from prima.coordinator.ring import Ring
from prima.errors import PrimaError
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net.client import NodeClient
from prima.scheduler.profile_schema import ModelProfile

pytestmark = pytest.mark.slow

BUDGET = 12 << 20  # the header and a few of SmolLM2's 2.1 MiB layers


def test_a_follower_keeps_to_its_disk_budget(smollm2_path: Path, tmp_path: Path, mdns_env: None) -> None:
    follower_file = tmp_path / "follower" / "model.gguf"
    logs = tmp_path / "logs"
    with GGUFFile(smollm2_path) as gguf:
        model = ModelProfile.from_gguf(gguf, ctx_tokens=256)
    with LocalRing.start(1, smollm2_path, threads=1, log_dir=logs / "holder") as holder:
        args = ("--fetch-from", holder.addresses[0], "--disk-budget", "12M")
        with LocalRing.start(
            1,
            smollm2_path,
            models=[follower_file],
            names=["follower"],
            threads=1,
            log_dir=logs,
            extra_args=args,
        ) as follower:
            client = NodeClient(follower.addresses[0])
            try:
                found = client.profile().device
            finally:
                client.close()
            assert found.held_layers == ()  # the header only, so far
            assert not found.holds_head_tensors
            assert found.disk_budget_bytes == BUDGET
            assert 0 < found.held_bytes == SparseFile.open(follower_file).held_bytes() < BUDGET

            # 20 layers (~42 MiB) for the follower: refused before a byte is fetched.
            addresses = [*holder.addresses, *follower.addresses]
            with pytest.raises(PrimaError, match="over its --disk-budget of 0.01 GiB"):
                Ring.connect(addresses, window_sizes=[10, 20])
            assert SparseFile.open(follower_file).held_bytes() == found.held_bytes

            # Halda plans the same two daemons within the budget, and the follower takes it on.
            views: list[ClusterView] = []
            ring = Ring.connect(addresses, halda=HaldaOptions(model), on_plan=views.append)
            try:
                # The estimate came before the load: the follower fetches every layer it is given.
                (view,) = views
                assert view.plan == ring.plan
                for node, transfer in zip(ring.plan.nodes, view.transfers.nodes, strict=True):
                    fetched = len(transfer.layers)
                    assert fetched == (node.n_layers if node.node_id == "follower" else 0)
                held = SparseFile.open(follower_file).held_bytes()
                assert held <= BUDGET
                room = (BUDGET - found.held_bytes) // model.layer_bytes
                given = [n.n_layers for n in ring.plan.nodes if n.node_id == "follower"]
                assert sum(given) <= room
            finally:
                ring.close()
