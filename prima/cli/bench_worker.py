"""One engine of `prima bench` in its own process, started as `python -m prima.cli.bench_worker`:
a module of its own, importing nothing of prima's until the prima engine is asked for, so the
llama.cpp worker's peak RSS is llama.cpp's. (Started by multiprocessing's spawn instead, a worker
re-imported the `prima` command's main module, which set up prima's process, hashing without
OpenSSL included, in llama.cpp's worker too; earlier it had carried `prima.cli.cmd_bench`.)

    python -m prima.cli.bench_worker ENGINE GGUF THREADS MODE N_CTX FD

talks over the connection whose descriptor FD it inherited (multiprocessing.connection)."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

PROMPT_TEXT = (
    "The history of computing is a story of machines that got smaller, cheaper and faster, and of "
    "people who found new things to do with each generation of them. "
)

Step = Callable[[list[int], int], tuple[float, float]]


def run(engine: str, path: str, threads: int, mode: str, n_ctx: int, conn: Connection) -> None:
    """One engine in its own process: answers ("run", ids, n_gen) with (pp tok/s, tg tok/s)."""
    try:
        if engine == "prima":
            step = _prima_engine(path, threads, mode, n_ctx, conn)
        else:
            step = _llama_engine(path, threads, n_ctx, conn)
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                conn.send(_memory())
                return
            _, ids, n_gen = msg
            conn.send(step(ids, n_gen))
    except Exception as exc:  # reported to the parent, which raises
        conn.send(("error", f"{engine}: {type(exc).__name__}: {exc}"))


def _prima_engine(path: str, threads: int, mode: str, n_ctx: int, conn: Connection) -> Step:
    import prima.startup  # noqa: F401, I001 - first, as in `prima run`: hashing, thread pools
    import numpy as np

    from prima.engine.local import LocalEngine
    from prima.forward.loader import load_model

    loaded = load_model(path, threads=threads, mode=mode)
    text_ids = loaded.tokenizer.encode(PROMPT_TEXT * 40)
    conn.send([int(t) for t in text_ids])
    engine = LocalEngine(loaded.model, n_ctx=n_ctx)

    def step(ids: list[int], n_gen: int) -> tuple[float, float]:
        engine.reset()
        t0 = time.perf_counter()
        logits = engine.forward(ids)
        t1 = time.perf_counter()
        for _ in range(n_gen):
            logits = engine.forward([int(np.argmax(logits))])
        t2 = time.perf_counter()
        return len(ids) / (t1 - t0), n_gen / (t2 - t1)

    return step


def _llama_engine(path: str, threads: int, n_ctx: int, conn: Connection) -> Step:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
    )
    conn.send([])

    def step(ids: list[int], n_gen: int) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([int(np.argmax(llama_last_logits(llm)))])
        t2 = time.perf_counter()
        return len(ids) / (t1 - t0), n_gen / (t2 - t1)

    return step


def llama_last_logits(llm):  # a llama_cpp.Llama in, a numpy row out
    """The logits of the last token llama.cpp evaluated. Llama.scores is written only when
    every token's logits are kept (logits_all) and holds only n_batch rows, so it is not read."""
    import llama_cpp
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def _memory() -> tuple[float, float, float]:
    """(peak RSS, RssAnon, RssFile) of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    fields = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024.0
    except OSError:
        pass
    return peak, fields.get("RssAnon", 0.0), fields.get("RssFile", 0.0)


def main(argv: list[str]) -> None:
    engine, path, threads, mode, n_ctx, fd = argv
    run(engine, path, int(threads), mode, int(n_ctx), Connection(int(fd)))


if __name__ == "__main__":
    main(sys.argv[1:])
