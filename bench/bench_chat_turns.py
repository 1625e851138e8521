"""Time to first token, turn by turn, of a chat on this device: with the KV cache kept between
turns (what `prima chat --local` and `prima serve --local` do) and with every turn prefilled
from an empty cache (before #37).

    python bench/bench_chat_turns.py [-m smollm2-135m] [--turns 10] [--reply-tokens 100]
                                     [--exact] [--threads N] [--ring N [--mem-mib M]]

With `--ring N` the model is split evenly over a local ring of N primad processes: the kept
run's daemons keep 2 sessions (`--keep-sessions 2`) and its turns ask for theirs to be kept, the
empty-cache run's keep none (`--keep-sessions 0`). With `--mem-mib M` (root, cgroups v1) each
daemon runs in a memory cgroup of M MiB, as on a device with that much memory: a model bigger
than the ring's memory streams its layers from disk every pass, which is where a chat turn's
prefill costs most (`--ring 1 --mem-mib M` is one such device). The page cache is emptied
before each run; llama.cpp is not run then (it would run outside the limits).

Each user turn is ~100 tokens of text; the replies are generated greedily once (with the cache
kept), then the same conversation is run again turn by turn from an empty cache, each turn up
to its first token. Then llama.cpp (llama-cpp-python, if installed) runs the same prompts on
the same number of threads keeping its own KV cache between turns: before each timed turn it is
brought, untimed, to the tokens prima had cached, so both prefill the same new tokens. Prints
each turn's prompt length, cached tokens and time to first token (ms) each way, prima's kept
over llama.cpp's, and turn N over turn 1. Numbers from a loaded machine say little: say so.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from prima.coordinator.emulate import EmulatedDevice, cgroups_writable, drop_page_cache
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.generate import (
    GenerateRequest,
    GenerationResult,
    LocalGenerator,
    collect,
    stream_text,
)
from prima.engine.local import LocalEngine, local_generator
from prima.engine.prompt import chat_prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model

TOPICS = (
    "rivers",
    "mountains",
    "bridges",
    "libraries",
    "volcanoes",
    "harbours",
    "deserts",
    "railways",
    "forests",
    "lighthouses",
    "glaciers",
    "markets",
)
ASKS = (
    "Describe how they form or are built, who uses them, and what changes them over a century.",
    "Compare two famous examples, say what makes each one unusual, and what a visitor notices first.",
    "Explain what goes wrong with them most often and how people have tried to prevent it.",
)


def user_turn(i: int) -> str:
    """About 100 tokens of question, different each turn."""
    topic = TOPICS[i % len(TOPICS)]
    lines = [f"Turn {i + 1}. Let us talk about {topic}."]
    lines += [ASKS[(i + k) % len(ASKS)] for k in range(3)]
    lines.append(f"Keep the answer about {topic} short, plain and concrete, in a few sentences.")
    return " ".join(lines)


class Forgetful:
    """An engine that starts every request from an empty cache: prima before #37."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.n_ctx = engine.n_ctx

    def reset(self) -> None:
        self.engine.reset()

    def forward(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.engine.forward(token_ids)  # type: ignore[arg-type]

    def hidden_states(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.engine.hidden_states(token_ids)  # type: ignore[arg-type]


@contextlib.contextmanager
def ring_generator(
    model: str, n: int, n_layers: int, keep: bool, exact: bool, mem_mib: int = 0
) -> Iterator[Ring]:
    """A ring of `n` local daemons over `model`, its layers split evenly; each in a memory
    cgroup of `mem_mib` MiB when given."""
    args = [*(("--exact",) if exact else ()), "--keep-sessions", "2" if keep else "0"]
    preexec = None
    if mem_mib:
        devices = [EmulatedDevice(f"chat{i}", mem_mib * 2**20) for i in range(n)]
        preexec = [d.preexec() for d in devices]
        drop_page_cache()
    with LocalRing.start(n, model, threads=1, extra_args=args, preexec=preexec) as local:
        sizes = [n_layers // n + (i < n_layers % n) for i in range(n)]
        ring = Ring.connect(local.addresses, window_sizes=sizes)
        try:
            yield ring
        finally:
            ring.close()


def run_turn(generator: object, loaded: LoadedModel, ids: list[int], max_tokens: int) -> GenerationResult:
    tok = loaded.tokenizer
    request = GenerateRequest(
        tuple(ids), max_tokens, SamplerConfig(), tuple(sorted(tok.stop_ids)), n_ctx=4096, keep_session=True
    )
    events = generator.generate(request)  # type: ignore[attr-defined]
    return collect(stream_text(events, ids, decoder=tok.stream_decoder()))


def llama_cpp_ttfts(
    path: Path, prompts: list[list[int]], cached: list[int], threads: int, exact: bool
) -> list[float] | None:
    """llama.cpp's time to first token (ms) per turn with its KV cache kept between turns: the
    first cached[i] tokens of prompts[i] evaluated untimed, the rest timed; None without
    llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    kv_type = 0 if exact else 1  # ggml_type F32 or F16, as prima's exact and q8 modes keep KV
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=4096,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=kv_type,
        type_v=kv_type,
        verbose=False,
    )
    llm.eval(prompts[0][:4])  # warm up, untimed
    times = []
    for ids, held in zip(prompts, cached, strict=True):
        _extend(llm, ids[:held])
        start = time.perf_counter()
        _extend(llm, ids)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _extend(llm: object, ids: list[int]) -> None:
    """llm's cache brought to hold exactly `ids`: the longest prefix it already holds kept."""
    held = list(llm._input_ids)  # type: ignore[attr-defined]
    keep = 0
    while keep < min(len(held), len(ids)) and held[keep] == ids[keep]:
        keep += 1
    llm.n_tokens = keep  # type: ignore[attr-defined]  # eval drops the cache past n_tokens
    if keep < len(ids):
        llm.eval(ids[keep:])  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply-tokens", type=int, default=100)
    p.add_argument("--exact", action="store_true", help="float32 activations and KV (--exact)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ring", type=int, default=0, help="split the model over a local ring of N daemons")
    p.add_argument("--mem-mib", type=int, default=0, help="each daemon in a memory cgroup of M MiB (root)")
    args = p.parse_args(argv)
    if args.mem_mib and not args.ring:
        p.error("--mem-mib limits the ring's daemons: give --ring N too (--ring 1 is one device)")
    if args.mem_mib and (why := cgroups_writable()):
        p.error(f"--mem-mib needs cgroups v1 as root: {why}")
    loaded = load_model(args.model, mode="exact" if args.exact else "q8", threads=args.threads)
    n_ctx = 4096
    meta = loaded.gguf.metadata

    n_layers = loaded.model.config.n_layers
    with contextlib.ExitStack() as stack:
        if args.ring:
            kept: object = stack.enter_context(
                ring_generator(args.model, args.ring, n_layers, True, args.exact, args.mem_mib)
            )
        else:
            kept = stack.enter_context(contextlib.closing(local_generator(loaded, n_ctx)))
        # The first passes (page faults, compiles) untimed.
        warm_ids = chat_prompt_ids(meta, loaded.tokenizer, [{"role": "user", "content": user_turn(99)}])
        run_turn(kept, loaded, warm_ids, 4)
        history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful teacher."}]
        prompts: list[list[int]] = []
        after: list[GenerationResult] = []
        for i in range(args.turns):
            history.append({"role": "user", "content": user_turn(i)})
            ids = chat_prompt_ids(meta, loaded.tokenizer, history)
            result = run_turn(kept, loaded, ids, args.reply_tokens)
            prompts.append(ids)
            after.append(result)
            history.append({"role": "assistant", "content": result.text})

    with contextlib.ExitStack() as stack:
        if args.ring:
            empty: object = stack.enter_context(
                ring_generator(args.model, args.ring, n_layers, False, args.exact, args.mem_mib)
            )
        else:
            empty = LocalGenerator(Forgetful(LocalEngine(loaded.model, n_ctx)))  # type: ignore[arg-type]
        run_turn(empty, loaded, warm_ids, 4)
        before = [run_turn(empty, loaded, ids, 1) for ids in prompts]

    threads = args.threads or os.cpu_count() or 1
    cached = [r.timings.cached_tokens for r in after]
    llama = None if args.mem_mib else llama_cpp_ttfts(loaded.path, prompts, cached, threads, args.exact)

    where = f"a local ring of {args.ring}" if args.ring else "this device"
    if args.mem_mib:
        where += f", each daemon in {args.mem_mib} MiB"
    print(f"{args.model} on {where}, {'exact' if args.exact else 'q8'} mode, {args.turns} turns")
    print("turn  prompt  cached  ttft_kept_ms  ttft_empty_ms  llama_cpp_kept_ms  kept/llama_cpp")
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        t = a.timings
        ours = f"{llama[i]:17.1f}  {t.prompt_ms / llama[i]:14.2f}" if llama else ""
        print(
            f"{i + 1:4d}  {t.prompt_tokens:6d}  {t.cached_tokens:6d}  {t.prompt_ms:12.1f}  "
            f"{b.timings.prompt_ms:13.1f}  {ours}"
        )
    last = args.turns - 1
    print(
        f"turn {args.turns} / turn 1 time to first token: kept "
        f"{after[last].timings.prompt_ms / after[0].timings.prompt_ms:.2f}x, empty cache "
        f"{before[last].timings.prompt_ms / before[0].timings.prompt_ms:.2f}x"
        + (f", llama.cpp kept {llama[last] / llama[0]:.2f}x" if llama else ", llama.cpp not run")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
