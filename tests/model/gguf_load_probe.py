"""Seeded corruptions of a whole model file (tensor data included), each loaded and run in a
child process of its own with a time limit and a resident-memory cap, as `prima run` would:
open, validate every layer, build the tokenizer, tokenize a prompt and compute its logits.

Each case ends one way: `refused` (a PrimaError), `same` (the original's tokens and logits, bit
for bit), `values` (it ran with the original's geometry, i.e. its config's shapes and every
tensor's name, type and shape, but other numbers: a corrupted hyperparameter or score no file
check can tell from a real one), `geometry` (it ran with other shapes: silent wrong geometry),
`crash` (any other exception), `hang` (past the time limit) or `memory` (past the cap). Used by
test_gguf_load_probe.py; `python -m tests.model.gguf_load_probe --cases 300` runs the full count
and prints each outcome's count."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from tests.model.gguf_corruptions import Corruption, Layout, apply, corruptions, layout_of

TIME_LIMIT_S = 10.0
RSS_CAP_MIB = 1024
POLL_S = 0.02
PROMPT = "The capital of France is"
BAD = ("geometry", "crash", "hang", "memory")
REPO = Path(__file__).resolve().parents[2]

# The child: load and run the model at argv[1], print one JSON line. A PrimaError is an answer;
# anything else escapes as a traceback and a non-zero exit.
CHILD = """
import hashlib, json, re, sys
from pathlib import Path
from prima.errors import PrimaError
out = {}
try:
    from prima.engine.local import LocalEngine
    from prima.forward.loader import load_model
    loaded = load_model(sys.argv[1], threads=1, download=False)
    ids = loaded.tokenizer.encode(sys.argv[2])
    logits = LocalEngine(loaded.model, n_ctx=32).forward(ids)
    c = loaded.model.config
    shapes = (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim,
              c.vocab_size, c.rope_dim, c.activation, c.sliding_window, c.swa_pattern)
    tensors = sorted((t.name, int(t.qtype), t.shape) for t in loaded.gguf.tensors.values())
    out["geometry"] = hashlib.sha256(repr((shapes, tensors)).encode()).hexdigest()
    out["output"] = hashlib.sha256(repr(list(ids)).encode() + logits.tobytes()).hexdigest()
except PrimaError as exc:
    out["refused"] = f"{type(exc).__name__}: {str(exc)[:200]}"
status = Path("/proc/self/status").read_text()
out["hwm_kib"] = int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
print(json.dumps(out))
"""


@dataclass
class Outcome:
    kind: str
    detail: str = ""
    hwm_kib: int = 0
    seconds: float = 0.0


@dataclass
class Report:
    outcomes: list[tuple[Corruption, Outcome]] = field(default_factory=list)

    def counts(self) -> Counter[str]:
        return Counter(o.kind for _, o in self.outcomes)

    def bad(self) -> list[tuple[Corruption, Outcome]]:
        return [(c, o) for c, o in self.outcomes if o.kind in BAD]


def run_child(path: Path, time_limit_s: float = TIME_LIMIT_S, rss_cap_mib: int = RSS_CAP_MIB) -> Outcome:
    """Load and run `path` in a fresh interpreter, killed past `time_limit_s` or once its
    resident set passes `rss_cap_mib` (read from /proc every POLL_S)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), PROMPT],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = ""
    peak_kib = 0
    while proc.poll() is None:
        if time.monotonic() - t0 > time_limit_s:
            killed = "hang"
        else:
            peak_kib = max(peak_kib, _rss_kib(proc.pid))
            if peak_kib > rss_cap_mib << 10:
                killed = "memory"
        if killed:
            proc.kill()
            break
        time.sleep(POLL_S)
    stdout, stderr = proc.communicate(timeout=30)
    seconds = time.monotonic() - t0
    if killed:
        return Outcome(killed, f"after {seconds:.1f} s, {peak_kib >> 10} MiB resident", peak_kib, seconds)
    if proc.returncode != 0 or not stdout.strip():
        return Outcome(
            "crash", stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"
        )
    got = json.loads(stdout.strip().splitlines()[-1])
    hwm = max(peak_kib, got["hwm_kib"])
    if hwm > rss_cap_mib << 10:
        return Outcome("memory", f"{hwm >> 10} MiB at its peak", hwm, seconds)
    if "refused" in got:
        return Outcome("refused", got["refused"], hwm, seconds)
    return Outcome("ran", json.dumps({"geometry": got["geometry"], "output": got["output"]}), hwm, seconds)


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _judge(ran: Outcome, original: dict[str, str]) -> Outcome:
    got = json.loads(ran.detail)
    if got["output"] == original["output"]:
        return Outcome("same", "", ran.hwm_kib, ran.seconds)
    kind = "values" if got["geometry"] == original["geometry"] else "geometry"
    return Outcome(kind, "", ran.hwm_kib, ran.seconds)


def _restore(work: Path, original: Path, c: Corruption) -> None:
    """Put the original's bytes back where `c` changed them."""
    with open(original, "rb") as src, open(work, "r+b") as dst:
        src.seek(c.at)
        dst.seek(c.at)
        if c.kind == "truncate":
            shutil.copyfileobj(src, dst)
        else:
            dst.write(src.read(len(c.data)))


def where(reader: GGUFReader, c: Corruption) -> str:
    """The metadata key or tensor info a corruption's first byte fell in."""
    for f in reader.fields.values():
        end = f.offset + sum(p.nbytes for p in f.parts)
        if f.offset <= c.at < end:
            return f"key {f.name}"
    return (
        "tensor infos"
        if reader.tensors and c.at >= min(f.offset for f in reader.fields.values())
        else "header"
    )


def probe(model: Path, cases: int, seed: int, workdir: Path, log: bool = False) -> Report:
    """`cases` seeded corruptions of a copy of `model` in `workdir`, each loaded in a child."""
    work = workdir / model.name
    shutil.copyfile(model, work)
    layout: Layout = layout_of(model)
    base = run_child(work)
    assert base.kind == "ran", f"the untouched copy does not run: {base}"
    original = json.loads(base.detail)
    reader = GGUFReader(model)
    report = Report()
    rng = np.random.default_rng(seed)
    for i, c in enumerate(corruptions(layout, cases, rng)):
        apply(work, c)
        try:
            outcome = run_child(work)
            if outcome.kind == "ran":
                outcome = _judge(outcome, original)
            if outcome.kind == "values":
                outcome.detail = where(reader, c)
        finally:
            _restore(work, model, c)
        report.outcomes.append((c, outcome))
        if log:
            print(f"{i + 1}/{cases} {c}: {outcome.kind} {outcome.detail[:120]}", flush=True)  # noqa: T201
    return report


def _main() -> None:
    from prima.model.files import resolve_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    report = probe(resolve_model("smollm2-135m"), args.cases, args.seed, args.workdir, log=args.verbose)
    peak = max(o.hwm_kib for _, o in report.outcomes) >> 10
    slowest = max(o.seconds for _, o in report.outcomes)
    print(  # noqa: T201 - the script's output
        f"{args.cases} corruptions in {time.monotonic() - t0:.0f} s: {dict(report.counts())}; "
        f"peak child VmHWM {peak} MiB, slowest child {slowest:.1f} s"
    )
    for c, o in report.outcomes:
        if o.kind in (*BAD, "values"):
            print(f"  {o.kind}: {c}: {o.detail[:300]}")  # noqa: T201


if __name__ == "__main__":
    _main()
