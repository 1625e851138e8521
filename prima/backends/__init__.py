"""Compute backends, chosen by name. Each backend is one module implementing base.Backend."""

from __future__ import annotations

from prima.backends.base import Backend
from prima.errors import InputError

__all__ = ["AVAILABLE_BACKENDS", "Backend", "get_backend"]

AVAILABLE_BACKENDS: tuple[str, ...] = ("cpu",)


def get_backend(name: str, threads: int | None = None, mode: str = "q8") -> Backend:
    """The backend called `name`, with at most `threads` worker threads (None: one per core).
    `mode`: "q8" (int8 activations at decode, the fast default) or "exact" (float32 throughout)."""
    if name == "cpu":
        from prima.backends.cpu import CpuBackend

        return CpuBackend(threads=threads, mode=mode)
    raise InputError(f"unknown backend {name!r}; available: {', '.join(AVAILABLE_BACKENDS)}")
