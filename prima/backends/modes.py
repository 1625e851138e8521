"""The CPU's arithmetic modes, named once: "q8" quantizes activations to int8 blocks for the
integer kernels (llama.cpp's arithmetic, the default), "exact" keeps float32 activations."""

from __future__ import annotations

Q8 = "q8"
EXACT = "exact"
MODES: tuple[str, ...] = (Q8, EXACT)


def cpu_mode(exact: bool) -> str:
    """The mode `--exact` selects."""
    return EXACT if exact else Q8
