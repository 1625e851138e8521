"""Throughput of the CPU kernels: GB/s of weight bytes streamed per matvec, ms per call.

Run: python bench/bench_kernels.py [--threads N] [--repeat R]
Prints one line per (format, shape, n); real-model tensors are used when the models are cached.
In the default q8 mode n <= 4 runs the decode kernels, larger n the int8 GEMM (prefill)."""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from prima.backends.cpu import CpuOps
from prima.kernels import formats
from prima.kernels.tensor import QTensor
from prima.model.gguf_file import GGUFFile
from prima.paths import models_dir

Q = GGMLQuantizationType
REAL = [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.ffn_down.weight"),  # Q4_1 576x1536
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.ffn_up.weight"),  # Q4_1 1536x576
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.ffn_gate.weight"),  # Q5_0 2048x640
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.ffn_down.weight"),  # Q6_K 640x2048
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.attn_output.weight"),  # Q4_K 640x1024
    ("gemma-3-270m-q4_k_m.gguf", "blk.0.attn_v.weight"),  # Q8_0 256x640
]
SYNTHETIC = [Q.F32, Q.F16, Q.BF16, *formats.QTYPES]  # every format prima runs


def synthetic(qtype: GGMLQuantizationType, rows: int, cols: int) -> QTensor:
    """Random bytes are fine for timing (NaN scales included: the kernels never branch on values)."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // elems * nbytes), dtype=np.uint8)
    if qtype == Q.F32:
        raw = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    return QTensor(f"synthetic.{qtype.name}", qtype, (rows, cols), raw)


def time_call(fn, repeat: int) -> float:
    """Median seconds per call after one warm-up (which also triggers numba compilation)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def report(backend, w: QTensor, ns: list[int], repeat: int) -> None:
    for n in ns:
        x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
        sec = time_call(lambda x=x: backend.matmul(w, x), repeat)
        print(
            f"{w.qtype.name:5s} {w.name:28s} {w.rows:6d}x{w.cols:<6d} n={n:<4d} "
            f"{sec * 1e3:8.3f} ms  {w.n_bytes / sec / 1e9:6.2f} GB/s weights"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--n", type=int, nargs="*", default=[1, 3, 64, 128])
    args = parser.parse_args()
    backend = CpuOps(threads=args.threads)
    for model, name in REAL:
        path = models_dir() / model
        if not path.exists():
            print(f"skip {model}: not in {models_dir()}")
            continue
        gguf = GGUFFile(path)
        info = gguf.tensors[name]
        report(backend, QTensor(name, info.qtype, info.shape, gguf.tensor_bytes(name)), args.n, args.repeat)
    for qtype in SYNTHETIC:
        report(backend, synthetic(qtype, 4096, 4096), [1], max(3, args.repeat // 10))


if __name__ == "__main__":
    main()
