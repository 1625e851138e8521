"""A daemon measuring itself for the scheduler: the generic probes (prima.scheduler.profiler) on
prima's own kernels, then one real layer timed on this node's model, to which the kernel speeds
are calibrated. Called through NodeRuntime.profile, which caches the result."""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from prima.model.loader import LoadedModel
from prima.scheduler.kernel_bench import calibrate_to_layer, kernel_flops
from prima.scheduler.profile import DeviceProfile, ModelProfile
from prima.scheduler.profiler import profile_device
from prima.weights.kv_cache import KVCache

log = logging.getLogger("prima.cluster")

LAYER_STEPS = 4  # decode steps through the timed layers: the first warms up, the best of the rest counts
# Time enough consecutive layers that their weights cannot all sit in the CPU caches, as in a
# real forward pass (one small layer run again and again would be read from cache).
TIMED_BYTES = 48 << 20


def measure_node(loaded: LoadedModel, node_id: str) -> DeviceProfile:
    """This device's profile for `loaded`'s model, with kernel speeds calibrated to a real layer."""
    model = ModelProfile.from_gguf(loaded.gguf)
    device = profile_device(node_id, model_path=loaded.path, kernel_bench=kernel_flops)
    try:
        layer_ms = time_one_layer(loaded)
    except (ValueError, OSError) as exc:  # a layer this node cannot map: keep the kernel speeds
        log.warning("could not time a layer of %s (%s); planning from kernel speeds alone", loaded.name, exc)
        return device
    return calibrate_to_layer(device, model, layer_ms)


def time_one_layer(loaded: LoadedModel, steps: int = LAYER_STEPS) -> float:
    """Best ms per layer of one decode step (one token) through the first few layers (about
    TIMED_BYTES of weights, at least one layer), their weights read in first."""
    model = loaded.model
    layer_bytes = max(ModelProfile.from_gguf(loaded.gguf).layer_bytes, 1)
    n = max(1, min(model.config.n_layers, -(-TIMED_BYTES // layer_bytes)))
    loaded.weights.validate(range(0, n))
    cache = KVCache(model.config, steps, range(n))
    h = np.full((1, model.config.d_model), 0.01, dtype=np.float32)
    best = math.inf
    for pos in range(steps):
        t0 = time.perf_counter()
        model.forward_layers(h, np.array([pos]), 0, n, cache)
        if pos:
            best = min(best, time.perf_counter() - t0)
    return best * 1e3 / n
