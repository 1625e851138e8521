"""Thread-pool settings that must be in the environment before numpy and numba load their pools.

Decode runs numba's OpenMP pool; prefill runs its own Python threads, each calling BLAS. A second
multi-threaded pool (OpenBLAS) would spin against OpenMP's workers on a small machine and slow a
prefill matmul by an order of magnitude or more. Importing this module applies the defaults
(that is its only job, so entry points import it before anything else); values the user has set
are kept."""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULTS: dict[str, str] = {
    # Prefill parallelism comes from prima's tile threads, so BLAS itself stays single-threaded.
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # libgomp's workers sleep between launches instead of spinning. On a loaded machine a
    # spinning worker burns the time slice the other one needs to reach the barrier, and decode
    # slows several-fold. This is only the default: where the machine is not shared that way, a
    # brief spin makes launches far cheaper, and the entry points that run a model replace it
    # with what prima.engine.thread_tuning measured here.
    "OMP_WAIT_POLICY": "PASSIVE",
}


# The keys configure() set itself (not the user), so that other engines started from prima
# (the llama.cpp worker of `prima bench`) can run with the user's environment instead.
APPLIED: set[str] = set()


def workers_spin(env: Mapping[str, str] = os.environ) -> bool:
    """Whether idle OpenMP workers spin before sleeping (libgomp's default, or the brief spin
    prima.engine.thread_tuning chooses) rather than sleep at once (OMP_WAIT_POLICY=passive): a
    parallel launch then costs microseconds, not a wake-up through the kernel."""
    return env.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"


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
