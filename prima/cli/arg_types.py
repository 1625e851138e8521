"""argparse types that reject bad values with a usage message instead of a traceback later."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (thread counts, daemon counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
