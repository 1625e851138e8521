"""A daemon measuring itself for the scheduler: the generic probes (prima.scheduler.profiler) on
prima's own kernels, then one real layer timed on this node's model, to which the kernel speeds
are calibrated (cached per model file); and the memory it may use, read fresh each time."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np

from prima.forward.loader import LoadedModel
from prima.model.byte_ranges import held_layers, holds_head_tensors
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net.client import NodeClient, Transport
from prima.net.codec import NodeProfile
from prima.scheduler.kernel_bench import calibrate_to_layer, kernel_flops
from prima.scheduler.memory import MemoryLimit, read_memory_limit
from prima.scheduler.profile import DeviceProfile, ModelProfile
from prima.scheduler.profile_cache import load_or_measure
from prima.scheduler.profiler import profile_device
from prima.weights.kv_cache import KVCache
from prima.weights.window import PAGE, Span, resident_bytes

log = logging.getLogger("prima.daemon")

LAYER_STEPS = 4  # decode steps through the timed layers: the first warms up, the best of the rest counts
# Time enough consecutive layers that their weights cannot all sit in the CPU caches, as in a
# real forward pass (one small layer run again and again would be read from cache).
TIMED_BYTES = 48 << 20


def measure_node(loaded: LoadedModel, node_id: str) -> DeviceProfile:
    """This device's profile for `loaded`'s model, with kernel speeds calibrated to a real layer."""
    model = ModelProfile.from_gguf(loaded.gguf)
    backend = loaded.model.backend

    def bench(fmt: str) -> float:  # the backend's own kernels, in the mode it will run
        return kernel_flops(fmt, matmul_fn=backend.matmul)

    device = profile_device(node_id, model_path=loaded.path, kernel_bench=bench)
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


def node_profile(
    loaded: LoadedModel,
    node_id: str,
    fingerprint: str,
    *,
    budget_bytes: int | None,
    peer_address: str = "",
    refresh: bool = False,
    cache_dir: Path | None = None,
    identity: Transport = None,
    store: SparseFile | None = None,
    disk_budget_bytes: int = 0,
) -> NodeProfile:
    """This device measured for the scheduler (cached per model file; `refresh` measures
    again), with the memory it may use now, what it holds of the model file (`store`) and its
    disk budget, plus the link to `peer_address` when one is given."""
    found = load_or_measure(
        node_id, fingerprint, lambda: measure_node(loaded, node_id), refresh=refresh, cache_dir=cache_dir
    )
    # Memory is read now, as the planner will use it: the cached profile's is from another time.
    limit = memory_limit(loaded)
    device = dataclasses.replace(
        found.profile, ram_total_bytes=limit.total, ram_available_bytes=limit.weights_budget()
    )
    if store is not None:
        device = with_holdings(device, loaded.gguf, store, disk_budget_bytes)
    if peer_address:
        peer = NodeClient(peer_address, identity=identity)
        try:
            latency_ms, bandwidth = peer.measure_link()
        finally:
            peer.close()
        device = dataclasses.replace(device, net_latency_ms=latency_ms, net_bandwidth_bytes_per_s=bandwidth)
    return NodeProfile(device, budget_bytes or 0, found.measured_unix_s)


def with_holdings(
    device: DeviceProfile, gguf: GGUFFile, store: SparseFile, disk_budget_bytes: int
) -> DeviceProfile:
    """`device` with what it holds of the model file now (read fresh, like its memory: fetches
    change it) and the disk budget it was started with."""
    if not store.partial:
        return dataclasses.replace(device, held_bytes=store.file_size, disk_budget_bytes=disk_budget_bytes)
    held = store.held()
    return dataclasses.replace(
        device,
        held_layers=held_layers(gguf, held),
        holds_head_tensors=holds_head_tensors(gguf, held),
        held_bytes=store.held_bytes(),
        disk_budget_bytes=disk_budget_bytes,
    )


def memory_limit(loaded: LoadedModel) -> MemoryLimit:
    """This process's memory limit, the model file's own resident pages not counted as code."""
    data = loaded.gguf.data
    model_span = Span(0, data.size // PAGE * PAGE)
    return read_memory_limit(ours_mapped=resident_bytes(loaded.gguf, model_span))


def window_budget(loaded: LoadedModel, node_id: str, is_head: bool) -> int:
    """Bytes of layer weights a node may keep resident, measured now: what its cgroup or host
    leaves, less the output head that the head node reads every token."""
    limit = memory_limit(loaded)
    budget = limit.weights_budget()
    if is_head:
        budget -= ModelProfile.from_gguf(loaded.gguf).head_resident_bytes
    log.info("node %s: %s; layer budget %d MiB", node_id, limit.describe(), budget >> 20)
    return max(budget, 1)
