"""Thread-pool settings that must be in the environment before numpy and numba load their pools.

Decode runs numba's OpenMP pool; prefill runs its own Python threads, each calling BLAS. A second
multi-threaded pool (OpenBLAS) would spin against OpenMP's workers on a small machine, which made
a 64-token matmul take 32-340 ms instead of 3-5 ms. Importing this module applies the defaults
(that is its only job, so entry points import it before anything else); values the user has set
are kept."""

from __future__ import annotations

import os

DEFAULTS: dict[str, str] = {
    # Prefill parallelism comes from prima's tile threads, so BLAS itself stays single-threaded.
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # libgomp's workers spin this many iterations (~1 ms) before sleeping: enough to catch the
    # next decode launch, short enough not to starve other work when a token is done.
    "GOMP_SPINCOUNT": "20000",
}


def configure() -> None:
    """Set the defaults above where the environment does not already choose. Has effect only if
    called before numpy (BLAS) and numba's OpenMP layer are first loaded."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


configure()
