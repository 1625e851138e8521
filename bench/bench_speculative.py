"""Speed-up of speculative decoding (prompt lookup, or a draft model) over plain decoding, same
run: on this device and on a local ring of 3 primad, for repetitive text (code, a list, quoting
the prompt) and for free text.

    python bench/bench_speculative.py [--model smollm2-135m] [-n 64] [--threads 1] [--draft-max 3]
                                      [--draft-model PATH_OR_NAME | --pair ceiling|floor]
                                      [--ceiling-type F32|F16|BF16] [--cache-dir DIR] [--skip-ring]
                                      [--hop-ms MS]

With --draft-model the drafts come from that model (on the ring, the head daemon's) instead of
prompt lookup. --pair measures the bounds of a draft model with pairs made from --model (see
speculative_pairs.py; written once into --cache-dir): `ceiling` runs a dequantized F32 (or
--ceiling-type F16 or BF16) copy of the model drafted for by the model itself (nearly every draft
accepted, a cheap draft: the best a real pair can do); `floor` runs the model drafted for by a
tiny random Qwen with its vocabulary (drafts almost always rejected: what a useless draft costs
with the back-off).

--hop-ms puts each ring daemon behind a link shaper (prima.net.link_shaper) adding that one-way
delay to every message to it, as a home Wi-Fi does (3-7 ms): there a token's trip round the ring
costs more than its compute, and accepted drafts share one trip.

Prints, per setup and text: ms per generated token plain and with drafts, the ratio
(plain / drafts: above 1 is a speed-up) and how many drafted tokens were accepted. Greedy, so
both runs must give the same tokens (checked). Run it on a quiet machine."""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import contextlib
import platform
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from speculative_pairs import CEILING_TYPES, ceiling_target, floor_draft

from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.engine.draft_model import load_draft_model
from prima.engine.generate import GenerateRequest, GenerationResult, Generator, collect, stream_text
from prima.engine.local import local_generator
from prima.engine.prompt import prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.forward.loader import LoadedModel, load_model
from prima.model.registry import resolve_model
from prima.net.link_shaper import LinkShape, shaped_daemons
from prima.paths import cache_root

TEXTS = {
    "code": (
        "def parse_line(line):\n    key, _, value = line.partition('=')\n    key = key.strip()\n"
        "    value = value.strip()\n    if not key:\n        raise ValueError(line)\n    return key, value\n\n"
        "# The same function with type hints:\ndef parse_line(line: str) -> tuple[str, str]:\n"
    ),
    "list": "Shifts:\n- Monday: Alice, Bob\n- Tuesday: Carol, Dave\n- Wednesday: Alice, Bob\n- Thursday: Carol, Dave\n-",
    "count": "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
    "quote": (
        "Text: The committee met on Tuesday to review the budget. After a long discussion, the members "
        "agreed to postpone the vote until the next meeting, when the final figures will be available.\n"
        "Repeat the text exactly.\nRepeated: The committee met on Tuesday"
    ),
    "free": "Once upon a time, in a small village by the sea, there lived",
}


def decode(generator: Generator, request: GenerateRequest) -> GenerationResult:
    events: Iterator[object] = generator.generate(request)  # type: ignore[assignment]
    return collect(stream_text(events, request.prompt_ids))  # type: ignore[arg-type]


def compare(name: str, generator: Generator, files: LoadedModel, n: int, draft: DraftConfig) -> None:
    stops = tuple(sorted(files.tokenizer.stop_ids))
    for text_name, text in TEXTS.items():
        ids = tuple(prompt_ids(files.tokenizer, text))
        plain_req = GenerateRequest(ids, n, SamplerConfig(), stops, n_ctx=1024)
        decode(generator, replace(plain_req, max_tokens=4))  # warm up (kernels, windows)
        decode(generator, replace(plain_req, max_tokens=4, draft=draft))  # and the draft's
        plain = decode(generator, plain_req)
        spec = decode(generator, replace(plain_req, draft=draft))
        if spec.token_ids != plain.token_ids:
            raise AssertionError(f"{name} {text_name}: drafts changed the greedy tokens")
        p, s = plain.timings, spec.timings
        ratio = p.ms_per_token / s.ms_per_token if s.ms_per_token else 0.0
        print(
            f"{name:8s} {text_name:6s} {p.generated_tokens:4d} tok  plain {p.ms_per_token:7.2f} ms/tok  "
            f"{draft.method} {s.ms_per_token:7.2f} ms/tok  x{ratio:5.2f}  "
            f"accepted {s.accepted_tokens}/{s.draft_tokens}"
        )


def pair(bound: str, model: str, ceiling_type: str, cache_dir: Path) -> tuple[str, str]:
    """(target, draft) paths of the pair that measures `bound` from `model`."""
    source = resolve_model(model)
    if bound == "ceiling":
        return str(ceiling_target(source, cache_dir, ceiling_type)), str(source)
    return str(source), str(floor_draft(source, cache_dir))


def cpu_name() -> str:
    """The CPU's model name (numbers mean little without it)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=64, help="tokens to generate per text")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--draft-model", default=None, help="draft with this model instead of prompt lookup")
    ap.add_argument("--pair", choices=("ceiling", "floor"), help="a draft model's bounds (see above)")
    ap.add_argument("--ceiling-type", choices=sorted(CEILING_TYPES), default="F32")
    ap.add_argument("--cache-dir", type=Path, default=cache_root() / "bench-pairs")
    ap.add_argument("--skip-ring", action="store_true", help="only this device")
    ap.add_argument("--hop-ms", type=float, default=0.0, help="one-way delay added to each ring hop (ms)")
    args = ap.parse_args()
    if args.pair and args.draft_model:
        ap.error("--pair makes its own draft model: drop --draft-model")
    if args.pair:
        args.model, args.draft_model = pair(args.pair, args.model, args.ceiling_type, args.cache_dir)
    draft = DraftConfig("model" if args.draft_model else "lookup", args.draft_max)
    drafts_from = f"--draft-model {args.draft_model}" if args.draft_model else "prompt lookup"
    print(
        f"# {args.model}, {args.threads} thread(s), --draft-max {args.draft_max}, {drafts_from}, {cpu_name()}"
    )
    loaded = load_model(args.model, threads=args.threads)
    draft_model = (
        load_draft_model(args.draft_model, loaded, threads=args.threads) if args.draft_model else None
    )
    single = local_generator(loaded, n_ctx=1024, draft_model=draft_model)
    try:
        compare("single", single, loaded, args.n, draft)
    finally:
        single.close()
    if args.skip_ring:
        return
    head_args = ["--draft-model", str(draft_model.loaded.path)] if draft_model else []
    link_ports = [free_port() for _ in range(3)]
    node_args = [
        [*extra, "--link-port", str(port)]
        for extra, port in zip([head_args, [], []], link_ports, strict=True)
    ]
    local = LocalRing.start(3, loaded.path, threads=args.threads, node_args=node_args)
    links = (
        shaped_daemons(local.addresses, link_ports, LinkShape(delay_ms=args.hop_ms))
        if args.hop_ms
        else contextlib.nullcontext((list(local.addresses), []))
    )
    try:
        with links as (addresses, _):
            ring = Ring.connect(addresses, rounds=1)
            try:
                compare(
                    f"ring-3{f' +{args.hop_ms:g} ms' if args.hop_ms else ''}", ring, loaded, args.n, draft
                )
            finally:
                ring.close()
    finally:
        local.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
