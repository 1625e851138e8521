"""The seam between a model and the hardware that computes it: a backend runs *windows* of
consecutive layers, the unit the ring hands out, so an accelerator that compiles a whole window
into one graph (the Ascend route: an offline model per window) plugs in as easily as the CPU.

A backend is bound to one model's weights (`get_backend(name, weights, ...)`). The engines and
the daemon use it like this:

    window = backend.load_window(range(10, 20))   # CPU: views over the mmap; NPU: a device copy
    kv = backend.new_kv(n_ctx, window.layers)      # the KV state of those layers, backend-owned
    h = backend.embed(token_ids)                   # on the ring's head
    h = backend.run_window(window, h, positions, kv)
    logits = backend.logits(h[-1:])                # on the head
    backend.release_window(window)                 # when the plan drops these layers

Each call to run_window appends the tokens at `positions` to `kv` (positions continue from what
`kv` holds, or restart earlier to overwrite), so prefill may be cut into micro-batches and
decode adds one token at a time. Backends state how close they are to llama.cpp
(`logit_tolerance`) and whether running layers in several windows gives the same bits as one
window (`windows_bit_identical`); tests/backends/test_conformance.py holds every backend to both.
Speculative decoding verifies draft tokens in batches of at most `batch_identical_tokens`, the
batch size up to which each token's row has the bits it has when the token runs alone. A daemon
cuts a long batch's rows into pieces of `row_piece_unit` rows (prima.forward.row_pieces) where
the backend promises that they keep the whole batch's bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, cast, runtime_checkable

import numpy as np

from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig


class KVState(Protocol):
    """A session's keys and values for some layers, in whatever form the backend keeps them."""

    n_ctx: int

    @property
    def n_bytes(self) -> int:
        """Host memory it takes (what a daemon's memory budget must leave room for)."""
        ...

    def truncate(self, length: int) -> None:
        """Forget every position >= length (the next write may start there)."""
        ...


class WindowHandle(Protocol):
    """A window of layers made ready to run; opaque beyond the layers it holds."""

    layers: range


class Backend(Protocol):
    name: str
    mode: str  # the arithmetic it runs, e.g. the CPU's "q8" or "exact"
    config: ModelConfig
    # Largest |logit - llama.cpp's f32 logit| this backend promises on F32 weights.
    logit_tolerance: float
    windows_bit_identical: bool
    # Up to this many tokens per run_window (and per logits call), each token's row is bit for
    # bit what it is computed alone: a batch of draft tokens then verifies exactly as plain
    # decoding would decide. 1 = no such promise.
    batch_identical_tokens: int
    # A batch cut into pieces of a multiple of this many rows from its first row (the last piece
    # taking the rest, never shorter), each layer's pieces run in row order, gives every row the
    # bits of the whole batch in one call (prima.forward.row_pieces). 0 = rows may not be cut.
    row_piece_unit: int
    # Computes on a device beside the host CPU (an NPU): a plan's accel_layers go to it.
    accelerator: bool

    def load_window(self, layers: range) -> WindowHandle:
        """Make `layers` ready to run (their weights must be valid in the model file)."""
        ...

    def release_window(self, window: WindowHandle) -> None:
        """Give back what load_window took; the handle is not used again."""
        ...

    def new_kv(self, n_ctx: int, layers: Iterable[int]) -> KVState:
        """Empty KV state for up to `n_ctx` positions of `layers`."""
        ...

    def run_window(
        self, window: WindowHandle, hidden: np.ndarray, positions: np.ndarray, kv: KVState
    ) -> np.ndarray:
        """Hidden states (n, d_model) float32 of the tokens at `positions` (n,) through every
        layer of `window`, in order; the tokens' keys and values are stored in `kv`."""
        ...

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Token ids (n,) -> hidden states (n, d_model) float32."""
        ...

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states (n, d_model) -> logits (n, vocab) float32 (final norm + output head)."""
        ...

    def output_norm(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states (n, d_model) -> the final norm's output (n, d_model), the output head's
        input (what embeddings are pooled from)."""
        ...

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T (float32), in the mode this backend runs: what the profiler times per
        weight format (prima.scheduler.kernel_bench) so that plans use this backend's speed."""
        ...


@runtime_checkable
class SessionBatching(Protocol):
    """A backend that runs the decode rows of several sessions in one pass over the weights
    (continuous batching), each row as it would be alone, up to `decode_batch_rows` rows."""

    decode_batch_rows: int

    def run_window_sessions(
        self,
        window: WindowHandle,
        hidden: np.ndarray,
        positions: np.ndarray,
        sessions: Sequence[tuple[KVState, int]],
    ) -> np.ndarray:
        """`run_window` over the rows of several sessions, each with its cache and row count."""
        ...


class AcceleratorBackend(Backend, Protocol):
    """A backend on a device beside the host CPU (`accelerator` is true). A node gives it the
    plan's `accel_layers` of each window and its `host` the rest of the window."""

    # The CPU backend of the same weights: embeddings, output head and the layers a plan
    # leaves on the CPU.
    host: Backend
    # Its memory is the host's RAM (unified memory): its layers count against RAM too.
    shares_ram: bool

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory now."""
        ...


@runtime_checkable
class CompilingBackend(Protocol):
    """A backend whose windows must be compiled before they load (the NPU's: minutes each with
    ATC). Compiling is a step of its own, before serving: see prima.engine.ahead_of_time."""

    def compiled(self, layers: range) -> bool:
        """Whether `layers` load without compiling."""
        ...

    def compile(self, layers: range) -> object:
        """Compile `layers` unless they are compiled."""
        ...

    def serve_compiled_only(self) -> None:
        """From now on load_window refuses a window that is not compiled."""
        ...

    def ready_windows(self) -> tuple[range, ...]:
        """The windows known to load without compiling (compiled, or found compiled), in order."""
        ...


def host_backend(backend: Backend) -> Backend:
    """The backend that computes on the host CPU: an accelerator's `host`, else `backend` itself."""
    if backend.accelerator:
        return cast(AcceleratorBackend, backend).host
    return backend
