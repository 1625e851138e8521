"""GGML tensor types and their block layouts (names and ids as in ggml.h)."""
