"""A ring where only node 0 holds the model file: the other daemons start with an empty model
directory and `--fetch-from` node 0, fetch the bytes of their windows when the plan arrives, and
the ring gives exactly the single-device tokens. Each follower's file is sparse, its allocated
blocks about its share; a re-plan that moves a window fetches only the new bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prima.cli.main import main
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.forward.loader import load_model
from prima.model.byte_ranges import needed_ranges, total_bytes
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.plan import Window

from .conftest import reference_tokens, ring_tokens

pytestmark = pytest.mark.slow

SLACK = 256 << 10  # blocks rounded up at each range's ends, and the record's own pages


def _share(model: Path, windows: tuple[Window, ...]) -> int:
    with GGUFFile(model) as gguf:
        return total_bytes(needed_ranges(gguf, windows, head=False))


def _check_sparse(model: Path, path: Path, windows: tuple[Window, ...]) -> int:
    """The follower's file: the whole model's size, holding exactly its windows' bytes, with
    about that many bytes of blocks allocated."""
    share = _share(model, windows)
    store = SparseFile.open(path)
    assert path.stat().st_size == model.stat().st_size
    assert store.held_bytes() == share
    allocated = path.stat().st_blocks * 512
    assert share <= allocated <= share + SLACK, (share, allocated)
    assert allocated < model.stat().st_size * 0.6
    return allocated


@pytest.mark.parametrize(
    ("model_fixture", "tag"), [("smollm2_path", "smollm2-135m"), ("gemma3_path", "gemma3-270m")]
)
def test_followers_without_the_file_fetch_their_windows_and_match_one_device(
    model_fixture: str,
    tag: str,
    request: pytest.FixtureRequest,
    oracle: Callable[[str], dict[str, Any]],
    tmp_path: Path,
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    prompt = oracle(tag)["prompts"][0]["prompt_token_ids"]
    expected = reference_tokens(model, prompt)
    stops = sorted(load_model(model, layers=range(0)).tokenizer.stop_ids)
    files = [tmp_path / f"node{i}" / "model.gguf" for i in (1, 2)]
    logs = tmp_path / "logs"
    with LocalRing.start(1, model, threads=1, log_dir=logs / "holder", extra_args=("--exact",)) as holder:
        args = ("--exact", "--fetch-from", holder.addresses[0])
        with LocalRing.start(
            2,
            model,
            models=files,
            names=["node1", "node2"],
            threads=1,
            log_dir=logs / "followers",
            extra_args=args,
        ) as followers:
            for f in files:  # before any plan: the header and fingerprint pages only
                assert SparseFile.open(f).held_bytes() < model.stat().st_size // 10
            ring = Ring.connect([*holder.addresses, *followers.addresses])
            try:
                assert ring_tokens(ring, prompt, stop_ids=stops) == expected
                before = [
                    _check_sparse(model, f, ring.plan.nodes[i + 1].windows) for i, f in enumerate(files)
                ]
                # Move two layers from node 2 to node 1: node 1 fetches just those, node 2 nothing.
                (w0,), (w1,), (w2,) = (node.windows for node in ring.plan.nodes)
                ring.load(window_sizes=[w0.n_layers, w1.n_layers + 2, w2.n_layers - 2])
                assert ring.plan.nodes[1].windows == (Window(w1.start, w1.end + 2),)
                assert ring_tokens(ring, prompt, stop_ids=stops) == expected
                assert SparseFile.open(files[0]).held_bytes() == _share(model, ring.plan.nodes[1].windows)
                assert SparseFile.open(files[1]).held_bytes() == _share(model, (w2,))
                assert files[1].stat().st_blocks * 512 == before[1]
            finally:
                ring.close()


def test_a_plan_by_hand_that_makes_a_node_fetch_prints_the_transfer_first(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/ring.md: before a plan that makes nodes fetch is loaded, `prima run` prints how much
    each will fetch; a plan by hand (--windows) too, not only Halda's."""
    logs = tmp_path / "logs"
    follower_file = tmp_path / "node1" / "model.gguf"
    with LocalRing.start(1, smollm2_path, threads=1, log_dir=logs / "holder") as holder:
        args = ("--fetch-from", holder.addresses[0])
        with LocalRing.start(
            1,
            smollm2_path,
            models=[follower_file],
            names=["node1"],
            threads=1,
            log_dir=logs / "f",
            extra_args=args,
        ) as follower:
            nodes = ",".join([*holder.addresses, *follower.addresses])
            argv = [
                "run",
                "-m",
                str(smollm2_path),
                "--nodes",
                nodes,
                "--windows",
                "15,15",
                "-p",
                "Hi",
                "-n",
                "2",
            ]
            assert main(argv) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "transfers before the first token" in x]
    assert "node1 15 layer(s)" in line
    assert "node0" not in line  # it holds the whole file
