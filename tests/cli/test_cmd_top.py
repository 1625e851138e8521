"""`prima top` against a real `prima serve` (its ApiServer on 127.0.0.1:0 over SmolLM2 on this
device): the cluster view as a table, JSON with --json, a bounded --watch, and errors that say
what to do when the server is not there or wants a key. On a ring: tests/api/test_serve_ring.py."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from prima.api.cluster_view import ClusterMonitor, read_local
from prima.api.server import ApiServer
from prima.api.service import CompletionService, ServeDefaults
from prima.cli.main import build_parser, main
from prima.engine.local import local_generator
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model

N_CTX = 128
KEY = "top-secret"
JOIN_TIMEOUT_S = 60.0


def _serve(smollm2_path: Path, api_key: str | None) -> Iterator[ApiServer]:
    loaded = load_model(smollm2_path)
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=4)
    service = CompletionService(loaded, local_generator(loaded, N_CTX), "smollm2-135m", N_CTX, defaults)
    monitor = ClusterMonitor("smollm2-135m", lambda: read_local(loaded, None))
    server = ApiServer(("127.0.0.1", 0), service, monitor=monitor, api_key=api_key)
    thread = server.serve_in_background()
    try:
        yield server
    finally:
        server.stop()
        thread.join(JOIN_TIMEOUT_S)


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[ApiServer]:
    yield from _serve(smollm2_path, None)


def test_top_prints_the_cluster_of_a_running_server(
    served: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", "--url", served.url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smollm2-135m on this device · 30 layers, 1 round(s), plan epoch 1")
    assert "over 0 request(s)" in out
    hops, nodes = out.split("\nhops (one forward pass)\n")[1].split("\nnodes\n")
    assert "[0,30)" in hops
    (header, row) = nodes.strip().splitlines()[:2]
    assert header.split()[:3] == ["node", "role", "status"]
    assert row.split()[1:3] == ["local", "ready"]


def test_top_json_and_a_bounded_watch(served: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--url", served.url, "--json", "--watch", "0.01", "--count", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    views = [json.loads(line) for line in lines]
    assert all(v["mode"] == "local" and v["nodes"][0]["windows"] == [[0, 30]] for v in views)


def test_top_says_when_no_server_listens(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before top connects: nothing listens there
    assert main(["top", "--url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}" in err
    assert "start `prima serve` or pass its address with --url" in err


def test_top_asks_for_the_api_key(smollm2_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for server in _serve(smollm2_path, KEY):
        assert main(["top", "--url", server.url]) == 1
        assert "needs an API key: pass --api-key or set $PRIMA_API_KEY" in capsys.readouterr().err
        assert main(["top", "--url", server.url, "--api-key", "wrong"]) == 1
        assert "refused the API key" in capsys.readouterr().err
        assert main(["top", "--url", server.url, "--api-key", KEY]) == 0
        assert "smollm2-135m on this device" in capsys.readouterr().out


def test_top_reads_where_serve_listens_by_default() -> None:
    """`prima top` with no --url reads a `prima serve` started with no --host or --port."""
    serve = build_parser(["serve"]).parse_args(["serve"])
    top = build_parser(["top"]).parse_args(["top"])
    assert top.url == f"http://{serve.host}:{serve.port}"
