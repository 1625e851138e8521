"""Guest side of bench/bench_arm_insn.py, run on aarch64 under qemu with the counting plugin: one
decode-sized q8 (or exact) matvec per format, called REPS times inside a counting window.

    probe.py REPS FORMAT:MODE ...      e.g. probe.py 5 Q4_1:q8 Q8_0:q8

Prints the kernel paths chosen, then one "window FORMAT MODE" line per window, in the order the
plugin writes its counts. Weights are random blocks with small scales: 576 x 1536, SmolLM2's
ffn_down, a matrix every format's blocks divide.
"""

import ctypes
import sys

import numpy as np
from gguf import GGMLQuantizationType

from prima.kernels import drivers, int8_dots
from prima.kernels.formats import load
from prima.kernels.quants import F16_TABLE

ROWS, COLS = 576, 1536
WINDOW_SYSCALL = 4095  # bench/arm_insn/insn_count.c's PRIMA_WINDOW


def matvec(qtype: GGMLQuantizationType, mode: str):
    """A call computing one matvec of `qtype` weights in `mode`, warmed up (compiled) once."""
    layout = load()[qtype].layout
    rng = np.random.default_rng(0)
    nb = ROWS * COLS // layout.elements
    blocks = rng.integers(0, 256, size=(nb, layout.nbytes), dtype=np.uint8)
    for off in layout.f16_offsets:
        halves = (rng.uniform(-1, 1, nb) * 0.05).astype(np.float16)
        blocks[:, off : off + 2] = halves.view(np.uint8).reshape(nb, 2)
    a = blocks.reshape(ROWS, -1)
    empty = a[:0]
    x = rng.standard_normal((1, COLS)).astype(np.float32)
    out = np.empty((1, ROWS), dtype=np.float32)
    if mode == "q8":

        def call() -> None:
            drivers.matvec_q8(int(qtype), a, empty, empty, x, out)
    else:

        def call() -> None:
            drivers.matvec(int(qtype), a, empty, empty, x, F16_TABLE, out)

    call()
    return call


def main() -> None:
    reps = int(sys.argv[1])
    cases = [arg.split(":") for arg in sys.argv[2:]]
    dotprod = getattr(int8_dots, "DOTPROD", False)  # absent before the sdot kernels: counts an older checkout
    print(f"paths DOTPROD={dotprod} AVX2={int8_dots.AVX2} LANES={int8_dots.LANES}", flush=True)
    libc = ctypes.CDLL(None)
    for name, mode in cases:
        call = matvec(GGMLQuantizationType[name], mode)
        libc.syscall(WINDOW_SYSCALL, 1)
        for _ in range(reps):
            call()
        libc.syscall(WINDOW_SYSCALL, 0)
        print(f"window {name} {mode}", flush=True)


if __name__ == "__main__":
    main()
