"""Compute backends, chosen by name; each implements base.Backend for one model's weights."""

from __future__ import annotations

from prima.backends.base import Backend
from prima.errors import InputError
from prima.model.weights import ModelWeights

__all__ = ["AVAILABLE_BACKENDS", "Backend", "get_backend"]

AVAILABLE_BACKENDS: tuple[str, ...] = ("cpu", "acl")


def get_backend(
    name: str,
    weights: ModelWeights,
    threads: int | None = None,
    mode: str = "q8",
    npu_ctx: int | None = None,
) -> Backend:
    """The backend called `name` for `weights`, with at most `threads` worker threads (None: one
    per core). `mode`: "q8" (int8 activations at decode, the fast default) or "exact" (float32
    throughout); "acl" (an Ascend NPU through CANN's pyACL) computes in "fp16" and uses `mode`
    for its host side (embeddings, output head, layers a plan leaves on the CPU); `npu_ctx` is the
    KV slots its compiled windows hold (None: acl's default), the longest context it serves."""
    if name == "cpu":
        from prima.backends.cpu import CpuBackend

        return CpuBackend(weights, threads=threads, mode=mode)
    if name == "acl":
        from prima.backends.acl import AclBackend
        from prima.backends.acl.backend import DEFAULT_CTX

        host_mode = "exact" if mode == "fp16" else mode
        return AclBackend(weights, threads=threads, ctx=npu_ctx or DEFAULT_CTX, host_mode=host_mode)
    raise InputError(f"unknown backend {name!r}; available: {', '.join(AVAILABLE_BACKENDS)}")
