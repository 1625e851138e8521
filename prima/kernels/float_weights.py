"""Half-width float weights (F16, BF16), as many downloads ship them: widened to float32 exactly
from their bits, by compiled loops that LLVM vectorizes.

  widen_f16_tile(a, start, out)   out (m, cols) = A[start : start + m] for float16 bits A
  widen_bf16_tile(a, start, out)  the same for bfloat16 bits
  matvec_bf16(a, b, c, x, out)    out (n, rows) = x @ [A; B; C].T for bfloat16 weights, a few rows of x

A prefill multiplies float32 tiles by BLAS, so each tile is widened first: numpy's conversion
from float16 does not use the CPU's instruction and takes longer than the product it feeds, and
its BF16 shift takes two passes and a uint32 temporary. The tile functions hold no GIL, so the
prefill threads widen their tiles at once. matvec_bf16 is drivers.matvec_f16 for bfloat16:
decode reads each weight once, as stored (drivers.float_matvec).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prima.kernels.drivers import HALF_LANES, float_matvec, row_group
from prima.kernels.lanes import bits_f32, half_to_f32


@njit(cache=True, inline="always")
def bf16_to_f32(b: np.uint16) -> np.float32:
    """A bfloat16 (its bits) as float32: the top half of a float32's bits, exactly."""
    return bits_f32(np.uint32(b) << np.uint32(16))


@njit(cache=True, nogil=True)
def widen_f16_tile(a: np.ndarray, start: int, out: np.ndarray) -> None:
    """out (m, cols) = rows [start, start + m) of float16 weights `a` (uint16 bits, rows x cols)."""
    for i in range(out.shape[0]):
        src = a[start + i]
        dst = out[i]
        for j in range(dst.shape[0]):
            dst[j] = half_to_f32(src[j])


@njit(cache=True, nogil=True)
def widen_bf16_tile(a: np.ndarray, start: int, out: np.ndarray) -> None:
    """widen_f16_tile for bfloat16 weights."""
    for i in range(out.shape[0]):
        src = a[start + i]
        dst = out[i]
        for j in range(dst.shape[0]):
            dst[j] = bf16_to_f32(src[j])


_BF16_FOUR, _BF16_TWO, _BF16_ONE = (row_group(bf16_to_f32, rows, HALF_LANES) for rows in (4, 2, 1))


@njit(parallel=True, cache=True)
def matvec_bf16(a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """drivers.matvec_f16 for bfloat16 weights."""
    float_matvec(a, b, c, x, out, _BF16_FOUR, _BF16_TWO, _BF16_ONE)
