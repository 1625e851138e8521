"""GEMV throughput of prima's own kernels, per weight format: the `kernel_bench` the profiler takes.

Each format is timed on one synthetic weight matrix in that format, one activation row (decode),
through `prima.kernels.matmul.matmul`, the call the forward pass makes. The weight bytes are a
fixed small pattern (normal f16/f32 values, no NaNs), since kernels do the same work whatever
the values. The whole bench is short: a few repeats per format, bounded in time.

A layer is more than its GEMVs (norms, attention, kernel dispatch). `calibrate_to_layer` scales
the measured throughputs by how much of a real layer's time the GEMVs account for, so the cost
model's per-layer time is the measured one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from prima.errors import InputError
from prima.ggml_constants import GGMLQuantizationType
from prima.kernels.matmul import matmul
from prima.kernels.quants import SUPPORTED_QTYPES, row_bytes
from prima.kernels.tensor import QTensor
from prima.scheduler.cost_model import gemv_ms
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile

# 1024 x 1024 weights: about a layer's GEMV in a small model (256 divides it, as K-quants need).
BENCH_ROWS = 1024
BENCH_COLS = 1024
BENCH_REPEATS = 8
BENCH_BUDGET_S = 0.05  # per format, after the warm-up call
# 0x11 in every byte: f16 0x1111 and f32 0x11111111 are small normal numbers.
_FILL = 0x11


def synthetic_weight(fmt: str, rows: int = BENCH_ROWS, cols: int = BENCH_COLS) -> QTensor:
    """A (rows, cols) weight stored as `fmt` (a ggml type name such as Q4_K)."""
    try:
        qtype = GGMLQuantizationType[fmt]
    except KeyError:
        raise InputError(f"unknown weight format {fmt!r}; use a ggml type name such as Q4_K") from None
    if qtype not in SUPPORTED_QTYPES:
        raise InputError(f"prima has no kernel for {fmt}; nothing to measure")
    raw = np.full((rows, row_bytes(qtype, cols)), _FILL, dtype=np.uint8)
    # Read-only, as weights mapped from a GGUF are: numba compiles one variant per array type, and
    # a writable one would be a kernel the warm-up did not compile (seconds in a first profile).
    raw.flags.writeable = False
    return QTensor(f"bench.{fmt}", qtype, (rows, cols), raw)


def kernel_flops(
    fmt: str,
    *,
    rows: int = BENCH_ROWS,
    cols: int = BENCH_COLS,
    repeats: int = BENCH_REPEATS,
    budget_s: float = BENCH_BUDGET_S,
    matmul_fn: Callable[[QTensor, np.ndarray], np.ndarray] | None = None,
) -> float:
    """FLOP/s of one-row matmul on a `fmt` weight (2 FLOPs per weight), best of up to `repeats`
    calls within `budget_s`. The first call is not timed: it may compile or load the kernel.
    `matmul_fn` is the backend's own matmul, in the mode it runs (Backend.matmul); without one,
    prima's CPU kernels in float32."""
    run = matmul_fn or matmul
    w = synthetic_weight(fmt, rows, cols)
    x = np.ones((1, cols), dtype=np.float32)
    run(w, x)
    best = math.inf
    deadline = time.perf_counter() + budget_s
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        run(w, x)
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 > deadline:
            break
    return 2.0 * rows * cols / max(best, 1e-9)


def calibrate_to_layer(device: DeviceProfile, model: ModelProfile, layer_ms: float) -> DeviceProfile:
    """Scale every format's throughput by the share of a real layer's time its GEMVs take, so
    that the cost model's per-layer time (GEMV FLOPs / throughput) equals `layer_ms`, the time
    this device measured for one decode step of one layer (norms, attention and dispatch
    included). Relative speeds of the formats are kept; without a usable time, unchanged."""
    gemv = gemv_ms(model.layer_flops, device.cpu_flops)
    if not (layer_ms > 0 and 0 < gemv < math.inf):
        return device
    scale = gemv / layer_ms
    return dataclasses.replace(device, cpu_flops={k: v * scale for k, v in device.cpu_flops.items()})
