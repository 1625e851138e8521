"""What the scheduler knows about a device and about a model: frozen profiles plus their JSON form.

Profiles travel between machines (a daemon measures itself, the coordinator plans) and are kept in
files for `prima plan`, so the JSON carries a schema version and is checked field by field on load:
a bad file raises InputError naming the field, never a KeyError from deep inside Halda.
Units are in the field names: bytes, bytes/s, FLOP/s, ms.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prima.errors import InputError
from prima.model.gguf_file import GGUFFile, metadata_get

SCHEMA_VERSION = 1
OS_CLASSES = ("linux", "android", "macos", "windows", "other")
DEFAULT_CTX_TOKENS = 4096
# The KV cache as Halda counts it: float32, exact mode's (prima.weights.kv_cache). q8 mode keeps
# halves, half of this, so its plans leave room to spare.
KV_ELEMENT_BYTES = 4
ACTIVATION_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class AcceleratorProfile:
    """A GPU or NPU beside the CPU. `shares_ram` is true for unified memory (Apple Metal, the
    Ascend NPU of an OrangePi): its layers then also count against the device's RAM.
    `compiled_windows` lists the layer ranges [start, end) it can run now, for an accelerator
    that runs only windows compiled ahead (an NPU: ATC takes minutes, a daemon never compiles
    inside a request); None when it runs any window."""

    kind: str
    memory_available_bytes: int
    flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    mem_bandwidth_bytes_per_s: float = 0.0
    shares_ram: bool = False
    compiled_windows: tuple[tuple[int, int], ...] | None = None

    def runs(self, layers: range) -> bool:
        """Whether it can run `layers` as one window now."""
        return self.compiled_windows is None or (layers.start, layers.stop) in self.compiled_windows


@dataclass(frozen=True)
class DeviceProfile:
    """One device as measured by the profiler. `cpu_flops` maps a ggml weight format name
    (`Q4_K`, `F32`, ...) to GEMV throughput in FLOP/s; a missing format falls back to `F32`.
    `net_*` describe the link this device sends activations over to the next ring member (the
    one link measured per device; Halda also prices fetching model bytes over it).

    What it holds of the model being planned: `held_layers` the layers every byte of which it
    has (None: the whole file), `holds_head_tensors` whether it has the embedding and output
    head, `held_bytes` all it holds of the file; `disk_budget_bytes` caps what it may hold after
    fetching (primad --disk-budget; 0 = no cap). `shared_disk` names the disk it streams from
    when other members may read the same one (scheduler.disk_sharing; "" = a disk of its own).
    `output_ms` is the output head's time for one token as this device measured it (0: not
    measured; the planner then derives it from the head's FLOPs)."""

    node_id: str
    address: str = ""
    os: str = "linux"
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    disk_read_bytes_per_s: float = 0.0
    mem_bandwidth_bytes_per_s: float = 0.0
    cpu_flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    accelerator: AcceleratorProfile | None = None
    net_latency_ms: float = 0.0
    net_bandwidth_bytes_per_s: float = math.inf
    held_layers: tuple[int, ...] | None = None
    holds_head_tensors: bool = True
    held_bytes: int = 0
    disk_budget_bytes: int = 0
    shared_disk: str = ""
    output_ms: float = 0.0  # the output head for one token, timed here (0: not timed)

    def holds_layer(self, layer: int) -> bool:
        return self.held_layers is None or layer in self.held_layers

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "device",
            "node_id": self.node_id,
            "address": self.address,
            "os": self.os,
            "ram_total_bytes": self.ram_total_bytes,
            "ram_available_bytes": self.ram_available_bytes,
            "swap_total_bytes": self.swap_total_bytes,
            "swap_free_bytes": self.swap_free_bytes,
            "disk_read_bytes_per_s": self.disk_read_bytes_per_s,
            "mem_bandwidth_bytes_per_s": self.mem_bandwidth_bytes_per_s,
            "cpu_flops": dict(self.cpu_flops),
            "accelerator": None if self.accelerator is None else _accel_to_dict(self.accelerator),
            "net_latency_ms": self.net_latency_ms,
            # JSON has no infinity: an unmeasured (local) link is written as null.
            "net_bandwidth_bytes_per_s": _finite_or_none(self.net_bandwidth_bytes_per_s),
            # null: the whole model file.
            "held_layers": None if self.held_layers is None else list(self.held_layers),
            "holds_head_tensors": self.holds_head_tensors,
            "held_bytes": self.held_bytes,
            "disk_budget_bytes": self.disk_budget_bytes,
            "shared_disk": self.shared_disk,
            "output_ms": self.output_ms,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DeviceProfile:
        r = _Fields(raw, "device profile")
        r.check_schema("device")
        os_class = r.text("os", "linux")
        if os_class not in OS_CLASSES:
            raise InputError(f"device profile: os must be one of {OS_CLASSES}, got {os_class!r}")
        accel_raw = raw.get("accelerator")
        accel = None
        if accel_raw is not None:
            if not isinstance(accel_raw, Mapping):
                raise InputError("device profile: accelerator must be an object or null")
            accel = _accel_from_dict(accel_raw)
        bandwidth = raw.get("net_bandwidth_bytes_per_s")
        return cls(
            node_id=r.text("node_id"),
            address=r.text("address", ""),
            os=os_class,
            ram_total_bytes=r.count("ram_total_bytes"),
            ram_available_bytes=r.count("ram_available_bytes"),
            swap_total_bytes=r.count("swap_total_bytes", 0),
            swap_free_bytes=r.count("swap_free_bytes", 0),
            disk_read_bytes_per_s=r.number("disk_read_bytes_per_s", 0.0),
            mem_bandwidth_bytes_per_s=r.number("mem_bandwidth_bytes_per_s"),
            cpu_flops=r.flops("cpu_flops"),
            accelerator=accel,
            net_latency_ms=r.number("net_latency_ms", 0.0),
            net_bandwidth_bytes_per_s=math.inf
            if bandwidth is None
            else r.number("net_bandwidth_bytes_per_s"),
            held_layers=r.layers("held_layers"),
            holds_head_tensors=r.flag("holds_head_tensors", True),
            held_bytes=r.count("held_bytes", 0),
            disk_budget_bytes=r.count("disk_budget_bytes", 0),
            shared_disk=r.text("shared_disk", ""),
            output_ms=r.number("output_ms", 0.0),
        )


@dataclass(frozen=True)
class ModelProfile:
    """The per-token cost of a model, layer by layer, as Halda needs it.

    `layer_bytes` is the largest layer's weight bytes (memory checks stay conservative);
    `layer_flops` maps weight format -> FLOPs per token of one average layer (2 per weight);
    `output_flops` likewise for the output head, which the head node runs;
    `draft_bytes` is what a draft model on the head holds (`draft_resident_bytes`), 0 for none.
    """

    name: str
    arch: str
    n_layers: int
    layer_bytes: int
    layer_flops: Mapping[str, float] = field(hash=False)
    kv_bytes_per_token_per_layer: int
    input_bytes: int
    output_bytes: int
    output_flops: Mapping[str, float] = field(hash=False)
    activation_bytes: int
    ctx_tokens: int = DEFAULT_CTX_TOKENS
    tied_output: bool = False  # the output head is token_embd itself
    draft_bytes: int = 0  # a draft model on the head: its weights and KV cache

    @property
    def head_resident_bytes(self) -> int:
        """What the head keeps in memory besides its layers: the output head, read in full every
        token (a tied one is the whole embedding), and its draft model if it has one. An untied
        embedding costs a row per token."""
        return self.output_bytes + (self.input_bytes if self.tied_output else 0) + self.draft_bytes

    def with_draft(self, draft: GGUFFile) -> ModelProfile:
        """This model as planned with `draft` drafting for it on the head, over the same context."""
        return dataclasses.replace(self, draft_bytes=draft_resident_bytes(draft, self.ctx_tokens))

    @property
    def kv_bytes_per_layer(self) -> int:
        """KV cache of one layer for the full planned context."""
        return self.kv_bytes_per_token_per_layer * self.ctx_tokens

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, ctx_tokens: int | None = None) -> ModelProfile:
        """Derive the profile from a GGUF index (no tensor data is read)."""
        meta = gguf.metadata
        arch = gguf.architecture

        def key(name: str, default: Any = None) -> Any:
            return metadata_get(meta, f"{arch}.{name}", default)

        n_layers = key("block_count")
        n_embd = key("embedding_length")
        n_head = key("attention.head_count")
        if n_layers is None or n_embd is None or n_head is None:
            raise InputError(
                f"{gguf.path}: metadata lacks {arch}.block_count/embedding_length/attention.head_count; "
                "is this a transformer GGUF?"
            )
        n_layers, n_embd, n_head = int(n_layers), int(n_embd), int(n_head)
        n_kv_head = int(key("attention.head_count_kv", n_head) or n_head)
        # K and V widths per head; most models have both equal to embedding_length / head_count.
        k_dim = int(key("attention.key_length", n_embd // n_head))
        v_dim = int(key("attention.value_length", k_dim))

        layer_bytes = [0] * n_layers
        layer_flops: dict[str, float] = {}
        for name, info in gguf.tensors.items():
            if not name.startswith("blk."):
                continue
            index = int(name.split(".")[1])
            if 0 <= index < n_layers:
                layer_bytes[index] += info.n_bytes
                # A GEMV does one multiply and one add per weight.
                fmt = _format_name(info.qtype)
                layer_flops[fmt] = layer_flops.get(fmt, 0.0) + 2.0 * info.n_elements / n_layers

        embd = gguf.tensors.get("token_embd.weight")
        out = gguf.tensors.get("output.weight")
        norm = gguf.tensors.get("output_norm.weight")
        input_bytes = embd.n_bytes if embd is not None else 0
        # A tied output head reuses token_embd: no extra bytes, but the same GEMV work.
        head_matrix = out if out is not None else embd
        output_bytes = (out.n_bytes if out is not None else 0) + (norm.n_bytes if norm is not None else 0)
        output_flops = (
            {} if head_matrix is None else {_format_name(head_matrix.qtype): 2.0 * head_matrix.n_elements}
        )

        max_ctx = int(key("context_length", DEFAULT_CTX_TOKENS) or DEFAULT_CTX_TOKENS)
        return cls(
            name=str(meta.get("general.name", gguf.path.stem)),
            arch=arch,
            n_layers=n_layers,
            layer_bytes=max(layer_bytes) if layer_bytes else 0,
            layer_flops=layer_flops,
            kv_bytes_per_token_per_layer=n_kv_head * (k_dim + v_dim) * KV_ELEMENT_BYTES,
            input_bytes=input_bytes,
            output_bytes=output_bytes,
            output_flops=output_flops,
            activation_bytes=n_embd * ACTIVATION_ELEMENT_BYTES,
            ctx_tokens=min(ctx_tokens or DEFAULT_CTX_TOKENS, max_ctx),
            tied_output=out is None and embd is not None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "model",
            "name": self.name,
            "arch": self.arch,
            "n_layers": self.n_layers,
            "layer_bytes": self.layer_bytes,
            "layer_flops": dict(self.layer_flops),
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token_per_layer,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "output_flops": dict(self.output_flops),
            "activation_bytes": self.activation_bytes,
            "ctx_tokens": self.ctx_tokens,
            "tied_output": self.tied_output,
            "draft_bytes": self.draft_bytes,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelProfile:
        r = _Fields(raw, "model profile")
        r.check_schema("model")
        n_layers = r.count("n_layers")
        if n_layers < 1:
            raise InputError(f"model profile: n_layers must be >= 1, got {n_layers}")
        return cls(
            name=r.text("name", ""),
            arch=r.text("arch", ""),
            n_layers=n_layers,
            layer_bytes=r.count("layer_bytes"),
            layer_flops=r.flops("layer_flops"),
            kv_bytes_per_token_per_layer=r.count("kv_bytes_per_token_per_layer"),
            input_bytes=r.count("input_bytes", 0),
            output_bytes=r.count("output_bytes", 0),
            output_flops=r.flops("output_flops"),
            activation_bytes=r.count("activation_bytes"),
            ctx_tokens=r.count("ctx_tokens", DEFAULT_CTX_TOKENS),
            tied_output=bool(raw.get("tied_output", True)),
            draft_bytes=r.count("draft_bytes", 0),
        )


def draft_resident_bytes(draft: GGUFFile, ctx_tokens: int) -> int:
    """Bytes a draft model keeps in the head's memory: every weight (each guess runs all its
    layers and its output head, so the whole file stays resident, not just a window) and one KV
    cache of `ctx_tokens` (capped at its own context, as prima.engine.draft_model sizes it)."""
    own = ModelProfile.from_gguf(draft, ctx_tokens=ctx_tokens)
    weights = sum(info.n_bytes for info in draft.tensors.values())
    return weights + own.n_layers * own.kv_bytes_per_layer


def devices_to_json(devices: Sequence[DeviceProfile], model: ModelProfile | None = None) -> str:
    """A cluster file for `prima plan`: the devices in ring order (head first), optionally a model."""
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "devices": [d.to_dict() for d in devices]}
    if model is not None:
        doc["model"] = model.to_dict()
    return json.dumps(doc, indent=2)


def load_cluster_file(path: str | Path) -> tuple[list[DeviceProfile], ModelProfile | None]:
    """Read a cluster file (see `devices_to_json`); a bare list of device profiles also works."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InputError(f"{path}: cannot read the devices file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(doc, list):
        doc = {"schema_version": SCHEMA_VERSION, "devices": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list) or not doc["devices"]:
        raise InputError(f'{path}: expected {{"devices": [...]}} with at least one device profile')
    _Fields(doc, str(path)).check_schema(None)
    devices = []
    for i, raw in enumerate(doc["devices"]):
        if not isinstance(raw, dict):
            raise InputError(f"{path}: devices[{i}] is not an object")
        devices.append(DeviceProfile.from_dict(raw))
    model_raw = doc.get("model")
    model = ModelProfile.from_dict(model_raw) if isinstance(model_raw, dict) else None
    return devices, model


# -- helpers -----------------------------------------------------------------------------------


def _format_name(qtype: Any) -> str:
    # TensorInfo.qtype is a GGMLQuantizationType, or a bare int for formats gguf-py lacks.
    return getattr(qtype, "name", str(qtype))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _accel_to_dict(a: AcceleratorProfile) -> dict[str, Any]:
    return {
        "kind": a.kind,
        "memory_available_bytes": a.memory_available_bytes,
        "flops": dict(a.flops),
        "mem_bandwidth_bytes_per_s": a.mem_bandwidth_bytes_per_s,
        "shares_ram": a.shares_ram,
        "compiled_windows": None if a.compiled_windows is None else [list(w) for w in a.compiled_windows],
    }


def _accel_from_dict(raw: Mapping[str, Any]) -> AcceleratorProfile:
    r = _Fields(raw, "accelerator")
    return AcceleratorProfile(
        kind=r.text("kind"),
        memory_available_bytes=r.count("memory_available_bytes"),
        flops=r.flops("flops"),
        mem_bandwidth_bytes_per_s=r.number("mem_bandwidth_bytes_per_s", 0.0),
        shares_ram=bool(raw.get("shares_ram", False)),
        compiled_windows=r.windows("compiled_windows"),
    )


_MISSING = object()


class _Fields:
    """Typed, non-negative field access over untrusted JSON with messages that name the field."""

    def __init__(self, raw: Mapping[str, Any], what: str) -> None:
        self.raw = raw
        self.what = what

    def check_schema(self, kind: str | None) -> None:
        version = self.raw.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise InputError(
                f"{self.what}: schema_version {version} is not supported (this prima reads {SCHEMA_VERSION}); "
                "re-run `prima profile` with this version"
            )
        if kind is not None and self.raw.get("kind", kind) != kind:
            raise InputError(f"{self.what}: kind is {self.raw.get('kind')!r}, expected {kind!r}")

    def _get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name, default)
        if value is _MISSING:
            raise InputError(f"{self.what}: missing field {name!r}")
        return value

    def text(self, name: str, default: Any = _MISSING) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise InputError(f"{self.what}: {name} must be a string, got {value!r}")
        return value

    def number(self, name: str, default: Any = _MISSING) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise InputError(f"{self.what}: {name} must be a number >= 0, got {value!r}")
        return float(value)

    def count(self, name: str, default: Any = _MISSING) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{self.what}: {name} must be an integer >= 0, got {value!r}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise InputError(f"{self.what}: {name} must be true or false, got {value!r}")
        return value

    def layers(self, name: str) -> tuple[int, ...] | None:
        """A sorted, distinct list of layer indices, or null (absent: null)."""
        value = self._get(name, None)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise InputError(f"{self.what}: {name} must be a list of layer indices >= 0 or null")
        return tuple(sorted(set(value)))

    def windows(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """A list of layer ranges [start, end) with start < end, or null (absent: null)."""
        value = self._get(name, None)
        if value is None:
            return None
        ok = isinstance(value, list) and all(
            isinstance(w, list)
            and len(w) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in w)
            and 0 <= w[0] < w[1]
            for w in value
        )
        if not ok:
            raise InputError(f"{self.what}: {name} must be a list of [start, end] layer ranges or null")
        return tuple(sorted({(w[0], w[1]) for w in value}))

    def flops(self, name: str) -> dict[str, float]:
        value = self._get(name, {})
        if not isinstance(value, Mapping):
            raise InputError(f"{self.what}: {name} must map weight format names to numbers")
        return {str(k): _Fields(value, f"{self.what}.{name}").number(k) for k in value}
