"""What a prima process sets up before the rest of prima loads: its entry points (`prima`,
`primad`, `prima bench`'s worker) import this module first.

- **Hashing without OpenSSL.** prima hashes model headers, tokenizer tables and kernel-cache
  keys with SHA-256, a few kilobytes per run, which CPython's built-in implementation does as
  well as OpenSSL's. Loading hashlib's OpenSSL binding (`_hashlib`) maps libcrypto and leaves
  megabytes of it resident in a process that never speaks TLS (`prima run --local`), so hashlib
  is made to use the built-in one. Nothing else changes: TLS (`ssl`,
  grpc, cryptography) links its own OpenSSL when a daemon needs it, and a process that has
  already loaded `_hashlib` keeps it.
- **Thread pools** (prima.kernels.thread_env): their environment, before numpy and numba load.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("_hashlib", None)  # type: ignore[arg-type]  # hashlib falls back to its built-ins

import prima.kernels.thread_env  # noqa: E402, F401
