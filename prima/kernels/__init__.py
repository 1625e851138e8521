"""Quant formats, their reference dequantizers, and the fused numba kernels.

Importing the package points numba's cache at prima's kernel cache (prima.paths), before any
kernel module defines its functions."""

from prima.kernels import compile_cache

compile_cache.configure()
