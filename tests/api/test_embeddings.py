"""/v1/embeddings on this device, end to end over real HTTP: the vectors equal llama.cpp's own
embeddings (llama-cpp-python computed live) for mean and last-token pooling, in both encodings;
bad input gets a 400 naming the field. The same on a ring: tests/api/test_serve_ring.py."""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prima.api.embeddings import parse_embeddings_request, pool
from prima.api.openai_schema import RequestError
from prima.api.server import ApiServer
from prima.api.service import CompletionService
from prima.engine.local import LocalEngine, local_generator
from prima.engine.prompt import prompt_ids
from prima.forward.loader import LoadedModel, load_model
from tests.conftest import tiny_model_path
from tests.llama_reference import llama_embeddings

N_CTX = 256
HTTP_TIMEOUT_S = 300.0  # a safety bound for a loaded CI machine, not an expectation
TEXTS = ["The capital of France is", "Embeddings place similar texts close together."]
# SmolLM2's file is Q4_1: llama.cpp then quantizes activations to q8_1 for its dot products,
# which prima does not copy bit for bit (the oracle's `quant` logits agree only to cosine 0.998).
# Measured on these texts: cosine >= 0.99925, components within 0.0125 of llama.cpp's.
MAX_COMPONENT_DIFF = 0.02
MIN_COSINE = 0.999
# On F32 weights both compute in float32 the same way: measured within 1.5e-7.
F32_MAX_COMPONENT_DIFF = 1e-5


@cache
def _smollm2(path: Path) -> LoadedModel:
    return load_model(path)


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[ApiServer]:
    loaded = _smollm2(smollm2_path)
    service = CompletionService(loaded, local_generator(loaded, N_CTX), "smollm2-135m", N_CTX)
    srv = ApiServer(("127.0.0.1", 0), service)
    thread = srv.serve_in_background()
    yield srv
    srv.stop()
    thread.join(HTTP_TIMEOUT_S)


def post_embeddings(url_host: str, port: int, body: Any) -> tuple[int, dict[str, Any]]:
    """POST /v1/embeddings; the status and the parsed JSON body."""
    conn = http.client.HTTPConnection(url_host, port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/embeddings", body=json.dumps(body).encode())
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def vectors_of(reply: dict[str, Any]) -> np.ndarray:
    """The embeddings of a reply in index order, decoding base64 ones as OpenAI's client does."""
    rows = sorted(reply["data"], key=lambda d: d["index"])
    return np.array(
        [
            np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4")
            if isinstance(r["embedding"], str)
            else r["embedding"]
            for r in rows
        ],
        dtype=np.float32,
    )


def assert_close_to_llama_cpp(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.abs(got - want).max() <= MAX_COMPONENT_DIFF
    assert (got * want).sum(axis=1).min() >= MIN_COSINE


def _call(server: ApiServer, body: Any) -> tuple[int, dict[str, Any]]:
    host, port = server.server_address[:2]
    return post_embeddings(str(host), port, body)


@pytest.mark.parametrize(("pooling", "encoding"), [("mean", "float"), ("last", "base64")])
def test_embeddings_equal_llama_cpp(
    server: ApiServer, smollm2_path: Path, pooling: str, encoding: str
) -> None:
    status, reply = _call(server, {"input": TEXTS, "pooling": pooling, "encoding_format": encoding})
    assert status == 200, reply
    assert reply["object"] == "list"
    assert reply["model"] == "smollm2-135m"
    tok = _smollm2(smollm2_path).tokenizer
    n_tokens = sum(len(prompt_ids(tok, t)) for t in TEXTS)
    assert reply["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    assert_close_to_llama_cpp(vectors_of(reply), llama_embeddings(smollm2_path, TEXTS, pooling))


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_f32_model_embeddings_equal_llama_cpp_to_float_precision(pooling: str) -> None:
    path = tiny_model_path("tiny-qwen2")
    loaded = load_model(path, mode="exact")
    got = np.array(
        [
            pool(LocalEngine(loaded.model, N_CTX).hidden_states(prompt_ids(loaded.tokenizer, t)), pooling)
            for t in TEXTS
        ]
    )
    assert np.abs(got - llama_embeddings(path, TEXTS, pooling)).max() <= F32_MAX_COMPONENT_DIFF


def test_embeddings_of_token_ids_equal_those_of_the_text(server: ApiServer, smollm2_path: Path) -> None:
    ids = prompt_ids(_smollm2(smollm2_path).tokenizer, TEXTS[0])
    _, by_text = _call(server, {"input": TEXTS[0]})
    status, by_ids = _call(server, {"input": ids})
    assert status == 200
    np.testing.assert_array_equal(vectors_of(by_ids), vectors_of(by_text))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], 3]}, "input"),
        ({"input": [[10**9]]}, "input"),
        ({"input": "x" * 2000}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "pooling": "cls"}, "pooling"),
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": "hi", "model": "gpt-4"}, "model"),
    ],
)
def test_bad_embedding_requests_name_the_field(server: ApiServer, body: Any, param: str) -> None:
    status, reply = _call(server, body)
    assert status in (400, 404)
    assert reply["error"]["param"] == param
    status, _ = _call(server, {"input": "still serving"})
    assert status == 200


def test_parse_takes_openais_four_input_forms() -> None:
    assert parse_embeddings_request({"input": "a"}).inputs == ("a",)
    assert parse_embeddings_request({"input": ["a", "b"]}).inputs == ("a", "b")
    assert parse_embeddings_request({"input": [1, 2]}).inputs == ((1, 2),)
    assert parse_embeddings_request({"input": [[1], [2, 3]]}).inputs == ((1,), (2, 3))
    with pytest.raises(RequestError, match="at most"):
        parse_embeddings_request({"input": ["a"] * 1000})


def test_pool_mean_and_last_are_unit_vectors_of_the_rows() -> None:
    hidden = np.array([[3.0, 0.0], [0.0, 4.0]], dtype=np.float32)
    np.testing.assert_allclose(pool(hidden, "mean"), np.array([0.6, 0.8]), rtol=1e-6)
    np.testing.assert_allclose(pool(hidden, "last"), np.array([0.0, 1.0]), rtol=1e-6)
