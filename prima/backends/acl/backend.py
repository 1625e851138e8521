"""The acl backend: windows of layers run on an Ascend NPU as offline models, through pyACL.

Each window is one graph (onnx_window), compiled by ATC (atc) and loaded on the device with its
input and output buffers. The KV cache lives on the device, one buffer for the keys of all of a
state's layers and one for the values, (layers, ctx, KVH, hd) float16 each (float32 on request:
twice the memory), so a window's consecutive layers are one contiguous piece of each: the
model's past_k/past_v inputs as they are. After each call the new keys and values are copied
into them device to device, so no cache crosses to the host. Tokens go through in gears (1, 2, 4, 8 at a time): a prefill of 13
tokens is three calls (8, 4, 1). Embedding and output head run on the host CPU.

Numerics: projections and attention's MatMuls in float16, the rest float32, so logits are within fp16 tolerance of
llama.cpp's f32 logits, not bit-equal: `logit_tolerance` below (the tiny F32 models, either
KV dtype), cosine
>= 0.999 and the same greedy tokens up to near-ties (tests/backends/test_conformance.py). Not
verified on a device: everything runs in the tests through a stand-in for pyACL (FakeAcl).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prima.backends.acl import atc
from prima.backends.acl.onnx_window import WindowGraph, window_graph, window_masks
from prima.backends.acl.runtime import DYNAMIC_DIMS_INPUT, AclError, AclRuntime, DeviceModel, open_runtime
from prima.backends.cpu import CpuBackend
from prima.errors import InputError, PlanError
from prima.kernels.tensor import QTensor
from prima.model.weights import ModelWeights
from prima.weights.kv_cache import WrittenPositions

log = logging.getLogger("prima.backends")

DEFAULT_CTX = 512  # cache slots a compiled window has; sessions may use up to this many
# The window a daemon's profile times (prima.daemon.node_profile.PROFILE_LAYERS), compiled when the
# backend is made so that the profile never runs ATC inside a request.
PROFILE_WINDOW = range(0, 1)


class WindowNotCompiledError(PlanError):
    """A plan gives this node NPU layers whose offline model is not in the acl cache, on a
    backend that no longer compiles (a serving daemon: ATC takes minutes, requests have seconds)."""


class AclKV:
    """Keys and values of some layers on the device: one buffer of keys and one of values,
    `ctx` slots per layer, layers in order (layer i's keys at k[i]), so consecutive layers are
    one contiguous piece (window()). Freed with the object (or by free())."""

    def __init__(
        self, runtime: AclRuntime, n_ctx: int, ctx: int, row_bytes: int, layers: Iterable[int]
    ) -> None:
        self.n_ctx = n_ctx
        self.layers = tuple(sorted(set(layers)))
        self.row_bytes = row_bytes  # one position: KVH * hd keys (or values) in the cache's dtype
        self.slot_bytes = ctx * row_bytes  # one layer's cache
        self.k: dict[int, int] = {}
        self.v: dict[int, int] = {}
        self._written = WrittenPositions(n_ctx, self.layers)
        ptrs: list[int] = []
        self._free = weakref.finalize(self, _free_all, runtime, ptrs)
        size = len(self.layers) * self.slot_bytes
        for table in (self.k, self.v) if size else ():
            base = runtime.malloc(size)
            ptrs.append(base)
            runtime.zero(base, size)  # unwritten slots are masked, but NaN * 0 is NaN
            table.update({i: base + j * self.slot_bytes for j, i in enumerate(self.layers)})

    @property
    def n_bytes(self) -> int:
        return 2 * len(self.layers) * self.slot_bytes

    def free(self) -> None:
        self._free()

    def window(self, layers: range) -> tuple[tuple[int, int], tuple[int, int]]:
        """The keys and the values of `layers` as device buffers (ptr, bytes): a window's
        past_k and past_v."""
        if not set(layers) <= set(self.layers):
            raise AclError(f"this KV state holds layers {self.layers}, not all of {layers} (prima bug)")
        n_bytes = len(layers) * self.slot_bytes
        return (self.k[layers.start], n_bytes), (self.v[layers.start], n_bytes)

    def reserve(self, layer: int, start: int, end: int) -> None:
        """Check that [start, end) can be written next (contiguous, within n_ctx)."""
        self._written.advance(layer, start, end)

    def truncate(self, length: int) -> None:
        self._written.truncate(length)


def _free_all(runtime: AclRuntime, ptrs: list[int]) -> None:
    for ptr in ptrs:
        runtime.free(ptr)


@dataclass
class AclWindow:
    """A window's offline model on the device, with its input and output buffers (ptr, bytes)
    by name, sized for the largest gear."""

    layers: range
    graph: WindowGraph
    model: DeviceModel
    buffers: dict[str, tuple[int, int]]
    released: bool = False


class AclBackend:
    """A model's windows on an Ascend NPU (device `device_id`), embeddings and head on the CPU.
    `ctx`: cache slots per compiled window; `gears`: token counts per call; `kv_dtype`: the
    device KV cache's, float16 or float32."""

    name = "acl"
    mode = "fp16"
    accelerator = True
    windows_bit_identical = False  # each window is its own compiled graph
    batch_identical_tokens = 1  # each gear is its own compiled graph too
    row_piece_unit = 0  # and so is each gear's row count
    logit_tolerance = 0.05  # |logit - llama.cpp f32| on the tiny F32 models (fp16 projections)

    def __init__(
        self,
        weights: ModelWeights,
        threads: int | None = None,
        *,
        ctx: int = DEFAULT_CTX,
        gears: Sequence[int] = atc.DEFAULT_GEARS,
        device_id: int = 0,
        soc: str = atc.DEFAULT_SOC,
        acl: Any = None,
        host_mode: str = "exact",
        kv_dtype: str = atc.DEFAULT_KV_DTYPE,
        progress: Callable[[str], None] | None = None,
        compile_profile_window: bool = True,
    ) -> None:
        self.weights = weights
        self.config = weights.config
        self.ctx = ctx
        self.gears = tuple(sorted(set(gears)))
        if not self.gears or self.gears[0] != 1:
            raise InputError(f"acl gears {gears} must include 1 (a decode step is one token)")
        atc.check_gears(self.gears)
        if kv_dtype not in ("float16", "float32"):
            raise InputError(f"acl KV cache dtype {kv_dtype!r}: use float16 or float32")
        self.kv_dtype = kv_dtype
        # One position of one layer's keys (or values) in the cache: KVH * hd elements.
        self._row_bytes = self.config.n_kv_heads * self.config.head_dim * np.dtype(kv_dtype).itemsize
        self.soc = soc
        # The 310B (OrangePi AIpro) has no memory of its own: its LPDDR4X is the host's RAM.
        self.shares_ram = soc.startswith("Ascend310B")
        self.progress = progress
        self.fingerprint = weights.gguf.fingerprint()
        self.compiles_on_load = True  # until serve_compiled_only()
        self._ready: dict[range, None] = {}  # windows seen compiled, for the profile (ready_windows)
        # Embeddings, output head, the profiler's matmul, and the layers a plan leaves on the CPU.
        self.host = CpuBackend(weights, threads=threads, mode=host_mode)
        self.runtime = open_runtime(device_id, acl)
        if compile_profile_window and self.config.n_layers:
            self._compile_ahead(PROFILE_WINDOW)

    def _compile_ahead(self, layers: range) -> None:
        """Compile `layers` now, as the backend is made (a daemon makes it before it serves), so
        that the profile times them without ATC; a failure is logged, and the profile then
        reports no accelerator until they are compiled."""
        try:
            self.compile(layers)
        except AclError as exc:
            log.warning(
                "could not compile layers %d-%d for the NPU's profile: %s; until they are compiled "
                "the node profiles as CPU-only",
                layers.start,
                layers.stop - 1,
                exc,
            )

    # -- windows -------------------------------------------------------------------------------
    def compile(self, layers: range) -> atc.WindowArtifacts:
        """Export and compile `layers` unless cached; the cache entry."""
        self.weights.validate(layers)
        art = self._artifacts(layers)
        atc.compile_window(self.weights, art, layers, self.ctx, self.progress)
        self._ready[layers] = None
        return art

    def serve_compiled_only(self) -> None:
        """From now on load_window loads only windows already compiled and raises
        WindowNotCompiledError for any other: called by a daemon before it serves, so that no
        request (a plan, a forward pass) waits minutes on ATC."""
        self.compiles_on_load = False

    def compiled(self, layers: range) -> bool:
        """Whether `layers` load without running ATC (their offline model is in the cache)."""
        found = self._artifacts(layers).om.is_file()
        if found:
            self._ready[layers] = None
        return found

    def ready_windows(self) -> tuple[range, ...]:
        """The windows this backend compiled or found compiled, which a coordinator may plan
        on its NPU (reported in the node's profile)."""
        return tuple(
            sorted((w for w in list(self._ready) if self.compiled(w)), key=lambda w: (w.start, w.stop))
        )

    def _artifacts(self, layers: range) -> atc.WindowArtifacts:
        return atc.artifacts(
            self.weights, self.fingerprint, layers, self.ctx, self.gears, self.soc, kv_dtype=self.kv_dtype
        )

    def load_window(self, layers: range) -> AclWindow:
        if self.compiles_on_load:
            art = self.compile(layers)
        else:
            art = self._artifacts(layers)
            if not art.om.is_file():
                raise self._not_compiled(layers)
        graph = window_graph(self.config, layers, self.ctx)
        model = self.runtime.load_model(art.om)
        buffers: dict[str, tuple[int, int]] = {}
        try:
            # Bound by name, in the order the model reports (ATC adds the dynamic-dims input).
            want = {*graph.inputs, DYNAMIC_DIMS_INPUT}
            if sorted(model.inputs) != sorted(want) or sorted(model.outputs) != sorted(graph.outputs):
                raise AclError(
                    f"{art.om} has inputs {model.inputs} and outputs {model.outputs}, not the window's; "
                    f"delete {art.directory} and compile again"
                )
            sizes = dict(zip(model.inputs, model.input_bytes, strict=True))
            sizes.update(zip(model.outputs, model.output_bytes, strict=True))
            for name, size in sizes.items():
                if not name.startswith("past_"):  # the KV state's own buffers go there
                    buffers[name] = (self.runtime.malloc(size), size)
        except AclError:
            _free_all(self.runtime, [p for p, _ in buffers.values()])
            self.runtime.unload(model)
            raise
        return AclWindow(layers, graph, model, buffers)

    def _not_compiled(self, layers: range) -> WindowNotCompiledError:
        first, last = layers.start, layers.stop - 1
        return WindowNotCompiledError(
            f"layers {first}-{last} are not compiled for this node's NPU (context {self.ctx}, gears "
            f"{','.join(map(str, self.gears))}), and a serving daemon does not run ATC (minutes) inside a "
            f"request: run `prima npu compile -m {self.weights.gguf.path} --window {layers.start}-{layers.stop} "
            f"--npu-ctx {self.ctx}` on this node, or restart primad with --npu-window {layers.start}-{layers.stop}, "
            "then load the plan again"
        )

    def release_window(self, window: AclWindow) -> None:
        if window.released:
            return
        window.released = True
        _free_all(self.runtime, [p for p, _ in window.buffers.values()])
        self.runtime.unload(window.model)

    def new_kv(self, n_ctx: int, layers: Iterable[int]) -> AclKV:
        if n_ctx > self.ctx:
            raise InputError(
                f"a context of {n_ctx} tokens is larger than the {self.ctx} KV slots the NPU windows are "
                f"compiled for: ask for at most {self.ctx} (prima --ctx), or compile and serve longer "
                f"windows (prima npu compile --npu-ctx N, primad --npu-ctx N)"
            )
        return AclKV(self.runtime, n_ctx, self.ctx, self._row_bytes, layers)

    def run_window(
        self, window: AclWindow, hidden: np.ndarray, positions: np.ndarray, kv: AclKV
    ) -> np.ndarray:
        if window.released:
            raise AclError(f"window {window.layers} was released; load it again")
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        outs = []
        at = 0
        while at < len(pos):
            n = max(g for g in self.gears if g <= len(pos) - at)
            outs.append(self._run_gear(window, h[at : at + n], pos[at : at + n], kv))
            at += n
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _run_gear(self, window: AclWindow, h: np.ndarray, pos: np.ndarray, kv: AclKV) -> np.ndarray:
        """One call of the window's model on n (a gear) tokens; their keys and values go into kv."""
        rt, g, model, n = self.runtime, window.graph, window.model, len(pos)
        start, end = int(pos[0]), int(pos[-1]) + 1
        for i in window.layers:
            kv.reserve(i, start, end)
        host = {"hidden": h, "positions": pos, "mask": window_masks(self.config, g, pos)}
        for name, array in host.items():
            rt.to_device(*window.buffers[name], array)
        past_k, past_v = kv.window(window.layers)
        bound = {"past_k": past_k, "past_v": past_v}
        inputs = [bound.get(name) or window.buffers[name] for name in model.inputs]
        outputs = [window.buffers[name] for name in model.outputs]
        shaped = [name for name in model.inputs if name != DYNAMIC_DIMS_INPUT]
        rt.execute(model, inputs, outputs, atc.full_dims(g, shaped, n))
        rows = n * kv.row_bytes  # new_k, new_v: (L, n, KVH, hd), layer by layer
        for j, i in enumerate(window.layers):  # the new rows into the cache, on the device
            for name, table in (("new_k", kv.k), ("new_v", kv.v)):
                dst = table[i] + start * kv.row_bytes
                rt.copy(dst, kv.slot_bytes - start * kv.row_bytes, window.buffers[name][0] + j * rows, rows)
        return rt.to_host(window.buffers["hidden_out"][0], np.empty((n, self.config.d_model), np.float32))

    # -- host side -----------------------------------------------------------------------------
    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.host.embed(token_ids)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.host.logits(hidden)

    def output_norm(self, hidden: np.ndarray) -> np.ndarray:
        return self.host.output_norm(hidden)

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """The host CPU's matmul: the profiler's kernel table is the CPU's; the NPU is profiled
        by timing a window (prima.backends.acl.profile)."""
        return self.host.matmul(w, x)

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of NPU memory now (acl.rt.get_mem_info)."""
        return self.runtime.memory()

    def close(self) -> None:
        """Give the device back; windows and KV states must have been released."""
        self.runtime.close()
