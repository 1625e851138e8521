"""The format table as compiled code: each step of prima.kernels.formats, picked by GGML type id.

numba binds a call to its callee when it compiles, so compiled code cannot fetch a kernel from a
table at run time. Each step is instead one generated function whose body is the if-chain one
would write by hand, one branch per format of the table:

    def dot(fmt, row, x, lut, out, r):
        if fmt == 2:  # Q4_0
            q4_0(row, x, lut, out, r)
        elif fmt == 3:  # Q4_1
            q4_1(row, x, lut, out, r)
        ...
        else:  # Q6_K
            q6_k(row, x, lut, out, r)

The last format takes the `else`: callers pass only ids of the table (they check QUANTIZED_IDS
or INT8_IDS first), and the drivers compile to the machine code a hand-written chain would give.
Generated source, not a chain of closures: numba inlines a closure by
copying its array arguments and counting references on the copies, once per row. The generated
functions have no source file, so numba cannot cache them on their own; the drivers that call
them are cached whole (prima.kernels.drivers), and tracebacks show the generated source.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Sequence

from numba import njit

from prima.ggml_constants import GGMLQuantizationType
from prima.kernels import formats

Kernel = Callable[..., None]

FORMATS: dict[GGMLQuantizationType, formats.QuantFormat] = formats.load()
# GGML type ids as plain ints, for numba.
QUANTIZED_IDS: frozenset[int] = frozenset(int(q) for q in FORMATS)
INT8_IDS: frozenset[int] = frozenset(int(q) for q, f in FORMATS.items() if f.qdot is not None)
GEMM_IDS: frozenset[int] = frozenset(int(q) for q, f in FORMATS.items() if f.unpack is not None)
_INT8_IDS: tuple[int, ...] = tuple(sorted(INT8_IDS))  # a global tuple is a constant to numba


@njit(cache=True, inline="always")
def has_int8(fmt: int) -> bool:
    """Whether format id `fmt` has an int8-activation kernel (qdot)."""
    return fmt in _INT8_IDS


def switch(
    step: str, params: Sequence[str], kernels: Sequence[tuple[GGMLQuantizationType, Kernel]]
) -> Kernel:
    """A numba function `step(fmt, *params)` that calls, with `params`, the kernel of `kernels`
    whose type id is fmt (as in the module docstring)."""
    args = ", ".join(params)
    lines = [f"def {step}(fmt, {args}):"]
    for i, (qtype, _) in enumerate(kernels):
        test = "if" if i == 0 else "else" if i == len(kernels) - 1 else "elif"
        cond = "" if test == "else" else f" fmt == {int(qtype)}"
        lines.append(f"    {test}{cond}:  # {qtype.name}")
        lines.append(f"        {qtype.name.lower()}({args})")
    source = "\n".join(lines) + "\n"
    filename = f"<prima.kernels.dispatch.{step}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, object] = {qtype.name.lower(): kernel for qtype, kernel in kernels}
    exec(compile(source, filename, "exec"), namespace)  # source built above from the table
    return njit(namespace[step])


# The steps of prima.kernels.formats with the format id first:
#   dot(fmt, row, x, lut, out, r), deq(fmt, row, lut, y), qdot(fmt, w, r0, r1, xq, xd, xs, out, c0),
#   unpack(fmt, row, u, sc, mn)
dot = switch("dot", ("row", "x", "lut", "out", "r"), [(q, f.dot) for q, f in FORMATS.items()])
deq = switch("deq", ("row", "lut", "y"), [(q, f.deq) for q, f in FORMATS.items()])
qdot = switch(
    "qdot",
    ("w", "r0", "r1", "xq", "xd", "xs", "out", "c0"),
    [(q, f.qdot) for q, f in FORMATS.items() if f.qdot is not None],
)
unpack = switch(
    "unpack", ("row", "u", "sc", "mn"), [(q, f.unpack) for q, f in FORMATS.items() if f.unpack is not None]
)
