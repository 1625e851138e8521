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
    # libgomp's workers spin briefly (2000 polls, ~0.1 ms) after a parallel launch, then sleep.
    # A decode step makes ~4 launches per layer with a few microseconds of Python between them:
    # workers that sleep at once pay a futex wake-up (~20 us on a VM) per launch, ~2 ms per
    # SmolLM2 token; workers that spin without limit burn the time slice the other thread needs
    # on a loaded machine (383 ms/token at GOMP_SPINCOUNT=20000 with the load average at 4.6 on 2
    # cores). OMP_WAIT_POLICY=passive (sleep at once) or active (always spin) override this.
    "GOMP_SPINCOUNT": "2000",
}


# The keys configure() set itself (not the user), so that other engines started from prima
# (the llama.cpp worker of `prima bench`) can run with the user's environment instead.
APPLIED: set[str] = set()


def configure() -> None:
    """Set the defaults above where the environment does not already choose. Has effect only if
    called before numpy (BLAS) and numba's OpenMP layer are first loaded. PRIMA_THREAD_ENV=off
    in the environment turns it off."""
    if os.environ.get("PRIMA_THREAD_ENV") == "off":
        return
    for key, value in DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            APPLIED.add(key)


configure()
