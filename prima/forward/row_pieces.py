"""A long micro-batch cut into pieces of rows that a node computes one at a time, each layer's
pieces in row order, so another session's step can run between two pieces instead of waiting for
a whole layer (prima.daemon.worker).

A piece must give its rows the bits the whole batch gives them. On the CPU a row's arithmetic
depends on the rows computed beside it in three ways, and pieces are cut to avoid all three:

- the kernel is chosen by row count: up to 4 rows the fused per-row kernels, above the int8 GEMM
  or BLAS (prima.kernels.matmul), so no piece may be that short;
- BLAS computes rows in register blocks of up to 16 and the int8 GEMM packs rows in groups of 8
  or 16, each cut from the batch's first row: a row at another offset in a block takes a
  narrower micro-kernel and sums in another order;
- attention runs in blocks of 16 query rows (prefill_attention.BLOCK_ROWS), each over the
  keys its rows see, and a block's key count sets the length of its sums;
- OpenBLAS multiplies small products (M*N*K up to 2^16 on x86-64 Haswell) with a kernel of their
  own: a piece of 32 rows by a tiny model's 32 x 64 weight took it, the whole batch did not.

So pieces are whole multiples of the backend's `row_piece_unit` (64 on the CPU) from the first
row, and the last piece takes the rest (never shorter than a piece); consecutive pieces may be
merged, which keeps those rules. Keys and values of earlier rows are in the cache before a later
piece attends to them, since pieces go in row order. Activations are quantized row by row (per
32-element block), which no cut changes.
"""

from __future__ import annotations


def piece_rows(unit: int, wanted: int) -> int:
    """The rows of a piece: `wanted` rounded up to a multiple of `unit` (0: no cutting)."""
    if unit <= 0:
        return 0
    return max(unit, -(-wanted // unit) * unit)


def row_pieces(n_rows: int, rows: int) -> list[slice]:
    """`n_rows` rows as consecutive pieces of `rows` rows, the last taking the rest (between
    `rows` and 2 * `rows` - 1): one piece when there are fewer than 2 * `rows`, or `rows` is 0."""
    if rows <= 0 or n_rows < 2 * rows:
        return [slice(0, n_rows)]
    starts = range(0, n_rows - rows + 1, rows)
    return [slice(a, a + rows if a + 2 * rows <= n_rows else n_rows) for a in starts]
