"""`prima serve --parallel`: eight streaming clients at once on this device all complete, every
one gets its first token before any other client's generation has finished (nobody waits for a
whole earlier generation), and each text equals the same request run alone (greedy).

The order is judged where the tokens are made, not where clients read them: a client thread
starved by a loaded machine would read late and blame the server. And generation starts once
all eight have their places (a bounded start line), so a client whose HTTP request arrived late
cannot find another already finished."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prima.api.server import ApiServer
from prima.api.service import CompletionService, EngineQueue, ServeDefaults
from prima.engine.generate import GenerateRequest, GenerationDone, TokenEvent, generate
from prima.engine.local import LocalEngine, LocalGeneratorPool, local_generator
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

CLIENTS = 8
MAX_TOKENS = 24
N_CTX = 256
HTTP_TIMEOUT_S = 300
START_LINE_TIMEOUT_S = 60
PROMPTS = [f"Question {i}: the largest city in country number {i} is" for i in range(CLIENTS)]


@dataclass
class ClientRun:
    text: str = ""
    error: str | None = None
    chunks: list[str] = field(default_factory=list)


@dataclass
class ServerSide:
    """When the pool yielded one request's first token and its end (monotonic seconds)."""

    first_token_s: float | None = None
    done_s: float | None = None


class TimedPool:
    """The real generator pool, timestamping each request's first token and its end as the pool
    yields them. Requests wait at a start line until `expected` have arrived (at most
    `timeout_s`: a server that runs them one by one fails the order check instead of hanging)."""

    def __init__(self, pool: LocalGeneratorPool, expected: int, timeout_s: float) -> None:
        self.pool = pool
        self.n_ctx = pool.n_ctx
        self.timeout_s = timeout_s
        self.runs: list[ServerSide] = []
        self._arrived = threading.Barrier(expected)

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        run = ServerSide()
        self.runs.append(run)
        try:
            self._arrived.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            pass
        for event in self.pool.generate(request):
            if isinstance(event, GenerationDone):
                run.done_s = time.monotonic()
            elif run.first_token_s is None:
                run.first_token_s = time.monotonic()
            yield event


@pytest.fixture(scope="module")
def loaded(smollm2_path: Path) -> LoadedModel:
    return load_model(smollm2_path, threads=2)


@pytest.fixture(scope="module")
def timed_pool(loaded: LoadedModel) -> Iterator[TimedPool]:
    pool = local_generator(loaded, N_CTX, parallel=CLIENTS)
    yield TimedPool(pool, CLIENTS, START_LINE_TIMEOUT_S)
    pool.close()


@pytest.fixture(scope="module")
def server(loaded: LoadedModel, timed_pool: TimedPool) -> Iterator[ApiServer]:
    defaults = ServeDefaults(sampler=SamplerConfig(), max_tokens=MAX_TOKENS)
    service = CompletionService(
        loaded,
        timed_pool,
        "smollm2-135m",
        timed_pool.n_ctx,
        defaults=defaults,
        queue=EngineQueue(slots=CLIENTS),
    )
    srv = ApiServer(("127.0.0.1", 0), service)
    thread = srv.serve_in_background()
    yield srv
    service.close()
    srv.stop()
    thread.join(HTTP_TIMEOUT_S)


def _client(srv: ApiServer, prompt: str, run: ClientRun, start: threading.Barrier) -> None:
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(str(host), port, timeout=HTTP_TIMEOUT_S)
    try:
        start.wait(HTTP_TIMEOUT_S)
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        resp = conn.getresponse()
        assert resp.status == 200
        for _ in range(10 * MAX_TOKENS):
            line = resp.readline()
            if not line:
                break
            payload = line.removeprefix(b"data: ").strip()
            if not payload:
                continue
            if payload == b"[DONE]":
                break
            piece = json.loads(payload)["choices"][0].get("text", "")
            run.chunks.append(piece)
        run.text = "".join(run.chunks)
    except Exception as exc:  # reported by the test, not lost in the thread
        run.error = repr(exc)
    finally:
        conn.close()


def test_eight_clients_at_once_all_start_before_any_finishes(
    server: ApiServer, timed_pool: TimedPool, loaded: LoadedModel
) -> None:
    runs = [ClientRun() for _ in PROMPTS]
    start = threading.Barrier(CLIENTS)
    threads = [
        threading.Thread(target=_client, args=(server, p, r, start))
        for p, r in zip(PROMPTS, runs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HTTP_TIMEOUT_S)
    assert [r.error for r in runs] == [None] * CLIENTS
    made = timed_pool.runs
    assert len(made) == CLIENTS
    assert all(m.first_token_s is not None and m.done_s is not None for m in made)
    for i, m in enumerate(made):
        others_done = min(o.done_s for j, o in enumerate(made) if j != i)  # type: ignore[type-var]
        assert m.first_token_s < others_done, f"request {i} waited for another request's whole generation"

    tok = loaded.tokenizer
    for prompt, r in zip(PROMPTS, runs, strict=True):
        alone = generate(
            LocalEngine(loaded.model, N_CTX),
            prompt_ids(tok, prompt),
            max_tokens=MAX_TOKENS,
            sampler=SamplerConfig(),
            stop_ids=sorted(tok.stop_ids),
            decoder=tok.stream_decoder(),
        )
        assert r.text == alone.text, prompt
