"""A daemon measuring itself for the scheduler: the generic probes (prima.scheduler.device_probe) on
prima's own kernels, then one real layer timed on this node's model, to which the kernel speeds
are calibrated (cached per model file); and the memory it may use, read fresh each time.

A node with an accelerator (an NPU backend) also times a one-layer window run there, and reads
the device's free memory (acl.rt.get_mem_info): its AcceleratorProfile, from which Halda decides
how many layers of each window (`accel_layers`) the device runs. The profile answers an RPC, so
it never compiles: the acl backend compiles that window when it is made, before the daemon
serves, and until it is compiled the node profiles as CPU-only."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np

from prima.backends.base import AcceleratorBackend, CompilingBackend, KVState
from prima.forward.loader import LoadedModel
from prima.forward.placement import Piece
from prima.model.byte_ranges import held_layers, holds_head_tensors
from prima.model.gguf_file import GGUFFile
from prima.model.sparse import SparseFile
from prima.net import limits
from prima.net.client import NodeClient, Transport
from prima.net.codec import NodeProfile
from prima.scheduler.cost_model import npu_layer_bytes
from prima.scheduler.device_probe import profile_device
from prima.scheduler.disk_sharing import shared_disk_key
from prima.scheduler.kernel_bench import calibrate_to_layer, kernel_flops
from prima.scheduler.memory import MemoryLimit, read_memory_limit
from prima.scheduler.profile_cache import load_or_measure
from prima.scheduler.profile_schema import AcceleratorProfile, DeviceProfile, ModelProfile
from prima.weights.window import PAGE, Span, resident_bytes

from .threads import use_threads

log = logging.getLogger("prima.daemon")

LAYER_STEPS = 10  # decode steps through the timed layers: the first warms up, the median of the rest counts
# Time enough consecutive layers that their weights stream from RAM, as in a real forward pass:
# layers that fit the last-level cache time faster than they run in a decode step, and Halda
# then predicts a ring too fast (docs/performance.md, "What the numbers rest on").
TIMED_BYTES = 128 << 20
# A ring member idles while the others compute, and its first launches after idling are slower
# (workers asleep, an idle vCPU descheduled), so each timed step starts after this idle time, as
# its steps in a ring do.
IDLE_BEFORE_STEP_S = 0.05
PROFILE_LAYERS = range(0, 1)  # the accelerator's timed window (prima.backends.acl's PROFILE_WINDOW)


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
    else:
        device = calibrate_to_layer(device, model, layer_ms)
    try:
        output_ms = time_output_head(loaded)
        if math.isfinite(output_ms):
            device = dataclasses.replace(device, output_ms=output_ms)
    except (ValueError, OSError) as exc:
        log.warning("could not time the output head of %s (%s); planning from its FLOPs", loaded.name, exc)
    if backend.accelerator:
        device = dataclasses.replace(device, accelerator=measure_accelerator(loaded, device))
    return device


def accelerator_ready(loaded: LoadedModel) -> bool:
    """Whether the accelerator's timed window loads without compiling (an NPU's offline model
    is cached; ATC takes minutes and never runs inside a request). A backend that compiles
    nothing is always ready."""
    compiled = getattr(loaded.model.backend, "compiled", None)
    return compiled is None or bool(compiled(PROFILE_LAYERS))


def time_one_layer(loaded: LoadedModel, steps: int = LAYER_STEPS) -> float:
    """Median ms per layer of one decode step (one token) on the host CPU through the first few
    layers (about TIMED_BYTES of weights, at least one layer), their weights read in first."""
    model = loaded.model
    layer_bytes = max(ModelProfile.from_gguf(loaded.gguf).layer_bytes, 1)
    n = max(1, min(model.config.n_layers, -(-TIMED_BYTES // layer_bytes)))
    loaded.weights.validate(range(0, n))
    piece = Piece(range(0, n), on_accel=False)
    return (
        _median_step_ms(
            lambda h, pos, kv: model.run(piece, h, pos, kv),
            model.host.new_kv(steps, piece.layers),
            loaded,
            steps,
        )
        / n
    )


def time_output_head(loaded: LoadedModel, steps: int = LAYER_STEPS) -> float:
    """Median ms of the output head for one token (final norm, projection onto the vocabulary),
    each step after idling as the head does while the token goes round the ring. Timed, not
    derived from FLOPs at a layer's speed: a head of one big matrix streams from RAM at its
    own rate (the 1 GB bench model's took ~2x its FLOP estimate, #18)."""
    model = loaded.model
    h = np.full((1, model.config.d_model), 0.01, dtype=np.float32)
    return _median_ms(lambda: model.output_logits(h), steps)


def measure_accelerator(
    loaded: LoadedModel, device: DeviceProfile, steps: int = LAYER_STEPS
) -> AcceleratorProfile | None:
    """The accelerator of `loaded`'s backend: one decode step through a one-layer window there
    (loaded as the plan's windows are; the first step warms up), as the throughput at which the
    cost model's GEMV time of a layer equals it, and its free memory now; None, with a warning,
    while that window is not compiled (this never compiles)."""
    accel = cast(AcceleratorBackend, loaded.model.backend)
    layers = PROFILE_LAYERS
    if not accelerator_ready(loaded):
        log.warning(
            "%s: layers %d-%d are not compiled for the accelerator, so this node profiles as "
            "CPU-only; restart primad (it compiles them before serving) or run `prima npu compile "
            "-m %s --window %d-%d` with the daemon's --npu-ctx",
            accel.name,
            layers.start,
            layers.stop - 1,
            loaded.name,
            layers.start,
            layers.stop,
        )
        return None
    loaded.weights.validate(layers)
    window = accel.load_window(layers)
    try:
        layer_ms = _median_step_ms(
            lambda h, pos, kv: accel.run_window(window, h, pos, kv),
            accel.new_kv(steps, layers),
            loaded,
            steps,
        )
    finally:
        accel.release_window(window)
    flops = ModelProfile.from_gguf(loaded.gguf).layer_flops
    per_s = sum(flops.values()) / (layer_ms / 1e3)
    free, _ = accel.device_memory()
    log.info("%s: %.2f ms per layer, %d MiB free", accel.name, layer_ms, free >> 20)
    return AcceleratorProfile(
        kind=accel.name,
        memory_available_bytes=free,
        flops={fmt: per_s for fmt in (*flops, "F32")},
        # Reading the KV cache at the planned context is not timed on the device: at the host's
        # memory speed, which a unified-memory NPU shares (one with its own is likely faster).
        mem_bandwidth_bytes_per_s=device.mem_bandwidth_bytes_per_s,
        shares_ram=accel.shares_ram,
    )


def _median_step_ms(
    run: Callable[[np.ndarray, np.ndarray, KVState], object], kv: KVState, loaded: LoadedModel, steps: int
) -> float:
    """Median ms of one decode step `run(hidden, positions, kv)` over `steps` steps, the first
    not counted, each after IDLE_BEFORE_STEP_S idle: what a token typically costs a ring member
    (the best step back to back is a lucky one)."""
    h = np.full((1, loaded.model.config.d_model), 0.01, dtype=np.float32)
    positions = iter(range(steps))
    return _median_ms(lambda: run(h, np.array([next(positions)]), kv), steps)


def _median_ms(step: Callable[[], object], steps: int) -> float:
    """Median ms of `step()` over `steps` calls, the first not counted, each after
    IDLE_BEFORE_STEP_S idle."""
    times = []
    for i in range(steps):
        if i:
            time.sleep(IDLE_BEFORE_STEP_S)
        t0 = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3 if times else math.inf


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
    again), with the memory it may use now (its accelerator's too), what it holds of the model
    file (`store`) and its disk budget, plus the link to `peer_address` when one is given."""
    backend = loaded.model.backend

    def measure() -> DeviceProfile:
        return measure_node(loaded, node_id)

    found = load_or_measure(node_id, fingerprint, measure, refresh=refresh, cache_dir=cache_dir)
    if backend.accelerator and found.profile.accelerator is None and accelerator_ready(loaded):
        # cached by a CPU-only run, or before the accelerator's window was compiled
        found = load_or_measure(node_id, fingerprint, measure, refresh=True, cache_dir=cache_dir)
    # Memory is read now, as the planner will use it: the cached profile's is from another time.
    limit = memory_limit(loaded)
    accel = found.profile.accelerator if backend.accelerator else None  # none without its backend
    if accel is not None:
        free, _ = cast(AcceleratorBackend, backend).device_memory()
        # Also read now: the windows it can run without compiling (a plan may name only those).
        ready = (
            tuple((w.start, w.stop) for w in backend.ready_windows())
            if isinstance(backend, CompilingBackend)
            else None
        )
        accel = dataclasses.replace(accel, memory_available_bytes=free, compiled_windows=ready)
    device = dataclasses.replace(
        found.profile,
        ram_total_bytes=limit.total,
        ram_available_bytes=limit.weights_budget(),
        accelerator=accel,
        # Like memory, read now: the daemons beside it and its disk throttle are this run's.
        shared_disk=shared_disk_key(loaded.path),
    )
    if store is not None:
        device = with_holdings(device, loaded.gguf, store, disk_budget_bytes)
        if not device.holds_head_tensors:  # its head was timed on holes in the file
            device = dataclasses.replace(device, output_ms=0.0)
    if peer_address:
        peer = NodeClient(peer_address, identity=identity)
        try:
            latency_ms, bandwidth = peer.measure_link()
        finally:
            peer.close()
        device = dataclasses.replace(device, net_latency_ms=latency_ms, net_bandwidth_bytes_per_s=bandwidth)
    return NodeProfile(device, budget_bytes or 0, found.measured_unix_s)


class NodeProfiler:
    """Answers Profile for a daemon serving `loaded` (see `node_profile`), one measurement at a
    time, on `threads` threads (None: the process's default)."""

    def __init__(
        self,
        loaded: LoadedModel,
        fingerprint: str,
        *,
        budget_bytes: int | None = None,
        threads: int | None = None,
        cache_dir: Path | None = None,
        identity: Transport = None,
        store: SparseFile | None = None,
        disk_budget_bytes: int = 0,
    ) -> None:
        self.loaded = loaded
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.threads = threads
        self.cache_dir = cache_dir
        self.identity = identity
        self.store = store
        self.disk_budget_bytes = disk_budget_bytes
        self._lock = threading.Lock()

    def profile(self, node_id: str, peer_address: str = "", refresh: bool = False) -> NodeProfile:
        """Node `node_id` measured now (or from its cache), with its link to `peer_address` when
        one is given; a malformed address is refused before anything is measured."""
        if peer_address:
            limits.check_address(peer_address)
        use_threads(self.threads)
        with self._lock:
            return node_profile(
                self.loaded,
                node_id,
                self.fingerprint,
                budget_bytes=self.budget_bytes,
                peer_address=peer_address,
                refresh=refresh,
                cache_dir=self.cache_dir,
                identity=self.identity,
                store=self.store,
                disk_budget_bytes=self.disk_budget_bytes,
            )


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


def window_budget(loaded: LoadedModel, node_id: str, is_head: bool, accel_layers: int = 0) -> int:
    """Bytes of layer weights a node may keep resident, measured now (before its accelerator
    layers are loaded): what its cgroup or host leaves, less the output head that the head node
    reads every token, less the accelerator's copies of its `accel_layers` layers where the
    accelerator shares the RAM."""
    limit = memory_limit(loaded)
    budget = limit.weights_budget()
    if is_head:
        budget -= ModelProfile.from_gguf(loaded.gguf).head_resident_bytes
    accel = accelerator_ram_bytes(loaded, accel_layers)
    budget -= accel
    log.info(
        "node %s: %s; the accelerator's %d layers take %d MiB of it; layer budget %d MiB",
        node_id,
        limit.describe(),
        accel_layers,
        accel >> 20,
        budget >> 20,
    )
    return max(budget, 1)


def accelerator_ram_bytes(loaded: LoadedModel, accel_layers: int) -> int:
    """RAM that `accel_layers` layers on `loaded`'s accelerator take from the host: on a SoC whose
    NPU shares the RAM (the 310B) its own fp16 copies with their gears and KV cache, as Halda
    plans them (cost_model.npu_layer_bytes); nothing where it has memory of its own."""
    backend = loaded.model.backend
    if accel_layers <= 0 or not backend.accelerator:
        return 0
    accel = cast(AcceleratorBackend, backend)
    if not accel.shares_ram or accel.name != "acl":
        return 0
    model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=getattr(accel, "ctx", None))
    return accel_layers * npu_layer_bytes(model)
