"""Quant formats, their reference dequantizers, and the fused numba kernels.

Importing the package points numba's cache at prima's kernel cache (prima.paths), before any
kernel module defines its functions."""

# The thread pools' environment before anything loads numpy (prima.kernels.thread_env).
from prima.kernels import thread_env  # noqa: F401

# isort: split
from prima.kernels import compile_cache

compile_cache.configure()
