"""Where prima keeps what it downloads, measures and compiles: one cache root and its parts.

The root is `$PRIMA_CACHE`, else `$XDG_CACHE_HOME/prima`, else `~/.cache/prima`. Under it:

  models/           GGUF files fetched by name
  profiles/         device profiles measured by primad (`$PRIMA_PROFILE_CACHE` overrides)
  kernels/<key>/    numba's compiled kernels, one directory per version of prima's kernel sources

The systemd unit and the container set XDG_CACHE_HOME=/var/cache, the one directory their
sandbox lets primad write. Keying the kernel directory on the sources matters: numba checks only
a function's own file before reusing its compiled code, so after an edit (or an upgrade) a kernel
cached from decode_layer.py would keep running old copies of the kernels it calls from other files.

Credentials are configuration, not cache: they live under config_root() (`$PRIMA_CONFIG`, else
`$XDG_CONFIG_HOME/prima`, else `~/.config/prima`), in `cluster/` (see prima/net/credentials.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

CACHE_ENV = "PRIMA_CACHE"
CONFIG_ENV = "PRIMA_CONFIG"
KERNEL_SOURCES = Path(__file__).resolve().parent / "kernels"


def cache_root() -> Path:
    """`$PRIMA_CACHE`, else `$XDG_CACHE_HOME/prima` (an absolute path, as the XDG spec asks),
    else `~/.cache/prima`."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "prima"
    return Path.home() / ".cache" / "prima"


def config_root() -> Path:
    """Where prima keeps what the user set up (the cluster's credentials): `$PRIMA_CONFIG`, else
    `$XDG_CONFIG_HOME/prima` (absolute), else `~/.config/prima`."""
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "prima"
    return Path.home() / ".config" / "prima"


def models_dir() -> Path:
    return cache_root() / "models"


def profiles_dir() -> Path:
    return cache_root() / "profiles"


def ring_state_file() -> Path:
    """The daemons `prima ring up --detach` started, for `prima ring down`."""
    return cache_root() / "ring.json"


def kernel_source_key() -> str:
    """A short hash of the kernel sources and of the Python and numba that compile them."""
    h = hashlib.sha256(f"{sys.version_info[:2]}".encode())
    h.update(_numba_version_file())
    for path in sorted(KERNEL_SOURCES.rglob("*.py")):  # the format modules sit in a subpackage
        h.update(path.relative_to(KERNEL_SOURCES).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _numba_version_file() -> bytes:
    """The bytes of installed numba's version module, found without importing numba (whose
    cache directory is set from this key first) or importlib.metadata (1.7 MiB resident, with
    the email and calendar modules it loads); b"no-numba" without numba (the numpy fallback,
    which compiles nothing)."""
    spec = importlib.util.find_spec("numba")
    if spec is None or spec.origin is None:
        return b"no-numba"
    version_file = Path(spec.origin).with_name("_version.py")
    try:
        return version_file.read_bytes()
    except OSError:
        return b"numba without " + str(version_file).encode()


def kernels_dir() -> Path:
    """numba's cache directory for this version of the kernels."""
    return cache_root() / "kernels" / kernel_source_key()
