"""Fetching a model's bytes from a peer over the FetchRanges stream, in-process on 127.0.0.1: a
node holds exactly the bytes it asked for in a sparse file; a broken stream (or a restart) resumes
without refetching what it has; a piece corrupted in transit or on disk is fetched again; bad
requests get precise statuses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from prima.daemon.fetching import WindowFetcher
from prima.errors import ModelFileError, NodeError
from prima.model.byte_ranges import ByteRange, bootstrap_ranges, needed_ranges, subtract, total_bytes
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net import fetch
from prima.net.client import NodeClient
from prima.net.fetch import Manifest, bootstrap, fetch_into, manifest_of
from prima.net.limits import MIN_RECEIVED_MESSAGE_BYTES
from prima.net.proto import prima_pb2 as pb
from prima.net.server import start_server
from prima.plan import Window, plan_from_window_sizes
from tests.tiny_models import write_tiny_model

PIECE = 64 << 10


class Holder:
    """The two methods of a daemon that the fetch RPCs use, over a whole model file."""

    def __init__(self, path: Path) -> None:
        self.gguf = GGUFFile(path)
        self.store = SparseFile.open(path, self.gguf.fingerprint())

    def manifest(self) -> Manifest:
        return manifest_of(self.store, "tiny", self.gguf.data_offset)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~10 MiB model of 4 layers."""
    return write_tiny_model(tmp_path_factory.mktemp("holder") / "m.gguf", n_layers=4, d_model=256, ffn=1024)


@pytest.fixture(scope="module")
def holder(model: Path) -> Iterator[str]:
    server, port = start_server(Holder(model), "127.0.0.1", 0, MIN_RECEIVED_MESSAGE_BYTES)  # type: ignore[arg-type]
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def client(holder: str) -> Iterator[NodeClient]:
    c = NodeClient(holder, identity="plaintext")
    yield c
    c.close()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[ByteRange]:
    """Every piece the holder sends, in order."""
    sent: list[ByteRange] = []
    real = fetch.piece_message

    def counting(store: SparseFile, r: ByteRange) -> pb.FilePiece:
        sent.append(r)
        return real(store, r)

    monkeypatch.setattr(fetch, "piece_message", counting)
    return sent


def _same_bytes(a: Path, b: Path, ranges: tuple[ByteRange, ...]) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for r in ranges:
            fa.seek(r.start)
            fb.seek(r.start)
            if fa.read(r.n_bytes) != fb.read(r.n_bytes):
                return False
    return True


def _window_ranges(path: Path, window: Window, head: bool = False) -> tuple[ByteRange, ...]:
    with GGUFFile(path) as gguf:
        return needed_ranges(gguf, [window], head=head)


def test_a_node_holds_exactly_its_windows_bytes_in_a_sparse_file(
    model: Path, client: NodeClient, tmp_path: Path
) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    with GGUFFile(store.path) as gguf, GGUFFile(model) as whole:
        assert gguf.fingerprint() == whole.fingerprint() == store.fingerprint
        header = bootstrap_ranges(whole.file_size, whole.data_offset)
    want = _window_ranges(model, Window(1, 3))
    stats = fetch_into(client, store, want, piece_bytes=PIECE)
    assert stats.written_bytes == total_bytes(want) - total_bytes(header)
    assert store.held() == want
    assert _same_bytes(model, store.path, want)
    # Blocks on disk: what it holds, rounded to blocks, far below the file.
    assert total_bytes(want) <= store.allocated_bytes() <= total_bytes(want) + 64 * 4096
    assert store.allocated_bytes() < model.stat().st_size * 0.7


def test_a_broken_stream_resumes_where_it_stopped(
    model: Path, client: NodeClient, tmp_path: Path, served: list[ByteRange], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    want = _window_ranges(model, Window(0, 4), head=True)
    counting = fetch.piece_message

    broke: list[int] = []

    def break_after_20(s: SparseFile, r: ByteRange) -> pb.FilePiece:
        if len(served) == 20 + len(header) and not broke:
            broke.append(len(served))
            raise ModelFileError("disk went away")  # ends the stream with an error status
        return counting(s, r)

    header = list(served)
    monkeypatch.setattr(fetch, "piece_message", break_after_20)
    stats = fetch_into(client, store, want, piece_bytes=PIECE)
    assert broke
    assert stats.streams == 2
    assert store.held() == want
    assert _same_bytes(model, store.path, want)
    assert len(set(served)) == len(served), "no piece was sent twice"
    # Every byte sent once: what the broken stream delivered is not asked for again.
    assert sum(r.n_bytes for r in served[len(header) :]) == stats.written_bytes
    assert stats.written_bytes == total_bytes(want) - total_bytes(header)


def test_a_restarted_node_fetches_only_what_it_lacks(
    model: Path, client: NodeClient, tmp_path: Path, served: list[ByteRange]
) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    fetch_into(client, store, _window_ranges(model, Window(0, 2)), piece_bytes=PIECE)
    store.close()
    before = len(served)
    again = bootstrap(tmp_path / "part.gguf", client)  # a restart: the record says what it holds
    more = _window_ranges(model, Window(0, 3))
    stats = fetch_into(client, again, more, piece_bytes=PIECE)
    layer2 = _window_ranges(model, Window(2, 3))
    assert stats.written_bytes == total_bytes(layer2) - total_bytes(_window_ranges(model, Window(2, 2)))
    assert all(r.start >= min(x.start for x in layer2) for r in served[before:])
    assert _same_bytes(model, again.path, more)


def test_a_piece_corrupted_in_transit_is_fetched_again(
    model: Path, client: NodeClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    real = fetch.piece_message
    flipped: list[ByteRange] = []

    def flip_third(s: SparseFile, r: ByteRange) -> pb.FilePiece:
        msg = real(s, r)
        if len(flipped) < 1 and r.n_bytes == PIECE:
            flipped.append(r)
            data = bytearray(msg.data)
            data[100] ^= 0x10  # after the sender hashed it: as if changed on the way
            msg.data = bytes(data)
        return msg

    monkeypatch.setattr(fetch, "piece_message", flip_third)
    want = _window_ranges(model, Window(1, 2))
    stats = fetch_into(client, store, want, piece_bytes=PIECE)
    assert stats.bad_pieces == 1
    assert stats.streams == 2
    assert store.held() == want
    assert _same_bytes(model, store.path, want)


def test_bytes_corrupted_on_disk_are_fetched_again(
    model: Path, holder: str, client: NodeClient, tmp_path: Path, served: list[ByteRange]
) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    plan = plan_from_window_sizes([("holder", holder), ("me", "127.0.0.1:9")], [2, 2], 1, 4)
    fetcher = WindowFetcher(store, "plaintext")
    with GGUFFile(store.path) as gguf:
        first = fetcher.ensure(gguf, plan, 1)
        assert first.written_bytes > 0
        assert fetcher.ensure(gguf, plan, 1).written_bytes == 0  # nothing missing: no transfer
        mine = _window_ranges(model, plan.nodes[1].windows[0])
        at = mine[-1].end - 10
        with open(store.path, "r+b") as fh:
            fh.seek(at)
            fh.write(b"\xff")
        before = len(served)
        again = fetcher.ensure(gguf, plan, 1)
    assert again.written_bytes <= fetch.DEFAULT_PIECE_BYTES
    assert [r for r in served[before:] if r.start <= at < r.end]
    assert _same_bytes(model, store.path, mine)


def test_no_peer_holding_the_bytes_is_an_error_that_says_what_to_do(
    tmp_path: Path, client: NodeClient
) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    plan = plan_from_window_sizes([("gone", "127.0.0.1:9"), ("me", "127.0.0.1:8")], [2, 2], 1, 4)
    with GGUFFile(store.path) as gguf, pytest.raises(NodeError, match="--fetch-from"):
        WindowFetcher(store, "plaintext").ensure(gguf, plan, 1)


def _call(client: NodeClient, **fields: object) -> grpc.StatusCode:
    try:
        list(client.stub.FetchRanges(pb.FetchRequest(**fields), timeout=10))  # type: ignore[arg-type]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        (
            lambda m: {"model_fingerprint": "00" * 32, "ranges": [pb.ByteSpan(start=0, end=10)]},
            "INVALID_ARGUMENT",
        ),
        (lambda m: {"ranges": [pb.ByteSpan(start=0, end=m.file_size + 1)]}, "INVALID_ARGUMENT"),
        (lambda m: {"ranges": [pb.ByteSpan(start=5, end=5)]}, "INVALID_ARGUMENT"),
        (lambda m: {"ranges": [pb.ByteSpan(start=1, end=2)] * (fetch.MAX_RANGES + 1)}, "RESOURCE_EXHAUSTED"),
        (lambda m: {"ranges": [pb.ByteSpan(start=0, end=10)], "piece_bytes": 1 << 31}, "OK"),
        (lambda m: {"ranges": [pb.ByteSpan(start=0, end=m.file_size)], "piece_bytes": 1}, "INVALID_ARGUMENT"),
        (
            lambda m: {
                "ranges": [pb.ByteSpan(start=0, end=1 << 20)],
                "piece_bytes": fetch.MIN_PIECE_BYTES - 1,
            },
            "INVALID_ARGUMENT",
        ),
        (
            lambda m: {"ranges": [pb.ByteSpan(start=0, end=1 << 20)], "piece_bytes": fetch.MIN_PIECE_BYTES},
            "OK",
        ),
    ],
)
def test_fetch_requests_are_checked(
    client: NodeClient, fields: Callable[[Manifest], dict[str, object]], code: str
) -> None:
    manifest = fetch.get_manifest(client)
    request = {"model_fingerprint": manifest.fingerprint, **fields(manifest)}
    assert _call(client, **request).name == code


def test_a_partial_holder_serves_only_what_it_holds(model: Path, client: NodeClient, tmp_path: Path) -> None:
    store = bootstrap(tmp_path / "part.gguf", client)
    partial = Holder.__new__(Holder)
    partial.gguf, partial.store = GGUFFile(store.path), store
    server, port = start_server(partial, "127.0.0.1", 0, MIN_RECEIVED_MESSAGE_BYTES)  # type: ignore[arg-type]
    c = NodeClient(f"127.0.0.1:{port}", identity="plaintext")
    try:
        manifest = fetch.get_manifest(c)
        assert not manifest.complete
        assert manifest.held == store.held()
        r = manifest.held[0]
        assert (
            _call(c, model_fingerprint=store.fingerprint, ranges=[pb.ByteSpan(start=r.start, end=r.end)]).name
            == "OK"
        )
        hole = subtract([ByteRange(0, store.file_size)], manifest.held)[0]
        far = pb.ByteSpan(start=hole.start, end=hole.end)
        assert _call(c, model_fingerprint=store.fingerprint, ranges=[far]).name == "INVALID_ARGUMENT"
    finally:
        c.close()
        server.stop(grace=None)
