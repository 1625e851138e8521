"""argparse types that reject bad values with a usage message instead of a traceback later."""

from __future__ import annotations

import argparse

from prima.errors import InputError


def positive_int(text: str) -> int:
    """An integer >= 1 (thread counts, daemon counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_bytes(text: str) -> int:
    """'0', '123456', '512M', '1.5G' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = float(number)
    except ValueError:
        raise InputError(f"cannot read {text!r} as bytes; use e.g. 800M, 2G or 123456") from None
    if value < 0:
        raise InputError(f"a size must be >= 0, got {text}")
    return int(value * scale)


def parse_budget(text: str) -> int | None:
    """--mem-budget: 'auto' -> None (what the cgroup or host leaves, read when a plan arrives),
    '0' -> 0 (no limit), else bytes."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_bytes(text)
    except InputError:
        raise InputError(
            f"--mem-budget: cannot read {text!r} as bytes; use auto, 0 (no limit) or a size such as 800M or 2G"
        ) from None
