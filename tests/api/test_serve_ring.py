"""`prima serve` on a ring: the head samples, so per generated token only a token id crosses the
network to the server, never a logit vector (a full vocabulary of float32 per token would be
~190 KiB for SmolLM2). Counted on the wire: every Generate reply the server receives is measured
by a gRPC interceptor on the head's channel. Real daemons on 127.0.0.1, real HTTP."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prima.api.cluster_view import ClusterMonitor, read_ring
from prima.api.server import ApiServer
from prima.api.service import CompletionService, ServeDefaults
from prima.cli.main import main
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import load_model
from prima.net.proto import prima_pb2_grpc as pb_grpc
from tests.api.test_embeddings import TEXTS, assert_close_to_llama_cpp, post_embeddings, vectors_of
from tests.llama_reference import llama_embeddings

pytestmark = pytest.mark.slow

N_CTX = 256
MAX_TOKENS = 16
PROMPT = "The capital of France is"
HTTP_TIMEOUT_S = 120
# A token reply is a varint id plus framing; the last one carries the stop reason and timings.
MAX_TOKEN_REPLY_BYTES = 16
MAX_DONE_REPLY_BYTES = 64


class _CountingCall:
    """A response stream that records the serialized size of every message read from it."""

    def __init__(self, call: Any, sizes: list[int]) -> None:
        self._call = call
        self._sizes = sizes

    def __iter__(self) -> _CountingCall:
        return self

    def __next__(self) -> Any:
        reply = next(self._call)
        self._sizes.append(reply.ByteSize())
        return reply

    def cancel(self) -> bool:
        return self._call.cancel()


class _ReplySizes(grpc.UnaryStreamClientInterceptor):
    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {}

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        sizes = self.sizes.setdefault(details.method, [])
        return _CountingCall(continuation(details, request), sizes)


@pytest.fixture(scope="module")
def ring(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ring]:
    local = LocalRing.start(
        2, smollm2_path, threads=1, extra_args=("--exact",), log_dir=tmp_path_factory.mktemp("logs")
    )
    try:
        ring = Ring.connect(local.addresses)
        try:
            yield ring
        finally:
            ring.close()
    finally:
        local.close()


def _complete(server: ApiServer, body: dict[str, Any]) -> dict[str, Any]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())
    finally:
        conn.close()


def test_serve_on_a_ring_receives_token_ids_not_logits(ring: Ring, smollm2_path: Path) -> None:
    counter = _ReplySizes()
    head = ring.head
    head.stub = pb_grpc.NodeStub(grpc.intercept_channel(head.channel, counter))
    loaded = load_model(smollm2_path, layers=range(0))  # the server only tokenizes
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=MAX_TOKENS)
    service = CompletionService(loaded, ring, "smollm2-135m", N_CTX, defaults=defaults)
    server = ApiServer(("127.0.0.1", 0), service)
    thread = server.serve_in_background()
    try:
        reply = _complete(server, {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    finally:
        service.close()
        server.stop()
        thread.join(HTTP_TIMEOUT_S)

    # The same text as the whole model on one device.
    exact = load_model(smollm2_path, mode="exact")
    ids = prompt_ids(exact.tokenizer, PROMPT)
    want = generate(
        LocalEngine(exact.model, N_CTX),
        ids,
        max_tokens=MAX_TOKENS,
        sampler=SamplerConfig(),
        stop_ids=sorted(exact.tokenizer.stop_ids),
        decoder=exact.tokenizer.stream_decoder(),
    )
    assert reply["choices"][0]["text"] == want.text
    assert reply["usage"]["completion_tokens"] == len(want.token_ids)

    # Only Generate streams came back, one reply per token plus the closing one, all small.
    assert set(counter.sizes) == {"/prima.v1.Node/Generate"}
    sizes = counter.sizes["/prima.v1.Node/Generate"]
    assert len(sizes) == len(want.token_ids) + (1 if want.stop_reason != "stop_string" else 0)
    assert max(sizes[:-1], default=0) <= MAX_TOKEN_REPLY_BYTES
    assert sizes[-1] <= MAX_DONE_REPLY_BYTES
    vocab_bytes = 4 * exact.model.config.vocab_size
    assert sum(sizes) < vocab_bytes // 100


def test_embeddings_on_a_ring_equal_llama_cpp(ring: Ring, smollm2_path: Path) -> None:
    """Every prompt row comes back round the ring (the last node sends all of them, not only
    the last), so mean pooling sees every token: the vectors equal llama.cpp's."""
    loaded = load_model(smollm2_path, layers=range(0))
    service = CompletionService(loaded, ring, "smollm2-135m", N_CTX)
    server = ApiServer(("127.0.0.1", 0), service)
    thread = server.serve_in_background()
    try:
        host, port = server.server_address[:2]
        replies = {
            pooling: post_embeddings(str(host), port, {"input": TEXTS, "pooling": pooling})
            for pooling in ("mean", "last")
        }
    finally:
        service.close()
        server.stop()
        thread.join(HTTP_TIMEOUT_S)
    for pooling, (status, reply) in replies.items():
        assert status == 200, reply
        assert_close_to_llama_cpp(vectors_of(reply), llama_embeddings(smollm2_path, TEXTS, pooling))


def test_top_shows_the_ring_with_each_hops_measured_time(
    ring: Ring, smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = load_model(smollm2_path, layers=range(0))
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=4)
    service = CompletionService(loaded, ring, "smollm2-135m", N_CTX, defaults=defaults)
    server = ApiServer(
        ("127.0.0.1", 0), service, monitor=ClusterMonitor("smollm2-135m", lambda: read_ring(ring))
    )
    thread = server.serve_in_background()
    try:
        _complete(server, {"prompt": PROMPT, "max_tokens": 4})
        assert main(["top", "--url", server.url]) == 0
    finally:
        service.close()
        server.stop()
        thread.join(HTTP_TIMEOUT_S)
    out = capsys.readouterr().out
    assert "on a ring of 2" in out
    hops = out.split("\nhops (one forward pass)\n")[1].split("\n\n")[0].splitlines()
    assert len(hops) == 3  # the header and one hop per node
    for row in hops[1:]:
        *_, compute, compute_unit, send, send_unit, steps = row.split()
        assert compute_unit == "ms"
        assert float(compute) > 0
        assert int(steps) >= 3
    assert [line.split()[1] for line in out.split("\nnodes\n")[1].splitlines()[1:3]] == ["head", "node"]


def _scrape(server: ApiServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_nodes_time_per_token_agrees_on_the_page_its_hops_and_metrics(
    ring: Ring, smollm2_path: Path
) -> None:
    """After a long prompt (whose prefill once made the node card read 3x low), a node's
    decode time per token is one number in its card, the sum of its hop rows, and /metrics;
    /metrics shows the ring's nodes, not a daemon's families at zero."""
    loaded = load_model(smollm2_path, layers=range(0))
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=8)
    service = CompletionService(loaded, ring, "smollm2-135m", N_CTX, defaults=defaults)
    monitor = ClusterMonitor("smollm2-135m", lambda: read_ring(ring))
    server = ApiServer(("127.0.0.1", 0), service, monitor=monitor)
    thread = server.serve_in_background()
    try:
        _complete(server, {"prompt": " ".join([PROMPT] * 12), "max_tokens": 8})
        view = monitor.snapshot()
        scraped = _scrape(server)
    finally:
        service.close()
        server.stop()
        thread.join(HTTP_TIMEOUT_S)
    assert not any(name.startswith("prima_node_compute_seconds") for name, _ in scraped)
    assert len(view.nodes) == 2
    for node in view.nodes:
        name = (("node", node.node_id),)
        assert scraped[("prima_node_up", name)] == 1
        assert scraped[("prima_node_owned_weight_bytes", name)] > 0
        hops = [h for h in view.hops if h.node_id == node.node_id]
        assert node.compute_ms_per_token is not None
        assert node.compute_ms_per_token == pytest.approx(sum(h.compute_ms or 0.0 for h in hops), rel=0.1)
        labels = [(("hop", str(i)), ("node", node.node_id)) for i, h in enumerate(view.hops) if h in hops]
        seconds = sum(scraped[("prima_node_hop_compute_seconds_total", lab)] for lab in labels)
        steps = scraped[("prima_node_hop_steps_total", labels[0])]
        assert steps >= 7  # 8 tokens, the first from the prompt
        assert node.compute_ms_per_token == pytest.approx(seconds * 1e3 / steps, rel=0.1)
