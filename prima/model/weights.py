"""Model weights as views into the GGUF mmap, named as GGUF names them (`attn_q`, `ffn_gate`, ...).

Nothing is dequantized or copied here except the small norm vectors; a node that owns a window
of layers builds LayerWeights only for those layers, so the pages of other layers are never
touched. Every tensor's shape is checked against the ModelConfig as its view is made: the kernels
trust shapes, so a file whose attn_q is narrower than its config says must stop here, not read
past a tensor's bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from prima.errors import ModelFileError
from prima.ggml_constants import GGMLQuantizationType
from prima.kernels.quants import check_supported
from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig, config_from_metadata
from prima.model.gguf_file import GGUFFile, TensorInfo

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Optional fields are None where the architecture has no such tensor."""

    index: int
    attn_norm: np.ndarray
    attn_q: QTensor
    attn_k: QTensor
    attn_v: QTensor
    attn_output: QTensor
    ffn_norm: np.ndarray
    ffn_gate: QTensor
    ffn_up: QTensor
    ffn_down: QTensor
    attn_q_bias: np.ndarray | None = None
    attn_k_bias: np.ndarray | None = None
    attn_v_bias: np.ndarray | None = None
    attn_q_norm: np.ndarray | None = None
    attn_k_norm: np.ndarray | None = None
    post_attention_norm: np.ndarray | None = None
    post_ffw_norm: np.ndarray | None = None


class ModelWeights:
    """Typed access to a GGUF's tensors; layer views are built on demand and cached."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        embd = self._info("token_embd.weight")
        if len(embd.shape) != 2:
            raise ModelFileError(
                f"{gguf.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, expected 2-D"
            )
        self.config: ModelConfig = config_from_metadata(
            gguf.metadata, vocab_size=embd.shape[0], path=gguf.path
        )
        self._check_layer_tensors()
        self._layers: dict[int, LayerWeights] = {}

    def _check_layer_tensors(self) -> None:
        """Refuse a file whose layer tensors go past its block count: it would run as a smaller
        model, silently ignoring the rest (a corrupt or mismatched `<arch>.block_count`)."""
        n = self.config.n_layers
        beyond = sorted(
            {
                int(idx)
                for name in self.gguf.tensors
                if (idx := _layer_index(name)) is not None and int(idx) >= n
            }
        )
        if beyond:
            raise ModelFileError(
                f"{self.gguf.path}: the file has tensors for layer(s) {beyond[0]}..{beyond[-1]} but its "
                f"metadata says {n} layer(s) ({self.config.arch}.block_count); the file is corrupt or "
                "was converted wrongly: re-download or re-convert it"
            )

    # -- tensors -------------------------------------------------------------------------------
    def _info(self, name: str) -> TensorInfo:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelFileError(
                f"{self.gguf.path}: tensor {name!r} is missing; the file is incomplete or not a "
                f"{self.gguf.architecture or 'supported'} model"
            )
        check_supported(info.qtype, name)
        return info

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _check_shape(self, info: TensorInfo, expected: tuple[int, ...]) -> None:
        if info.shape != expected:
            c = self.config
            raise ModelFileError(
                f"{self.gguf.path}: tensor {info.name!r} has shape {list(info.shape)} but the model's "
                f"metadata ({c.arch}: d_model {c.d_model}, {c.n_heads} heads of {c.head_dim}, "
                f"{c.n_kv_heads} KV heads, ffn {c.ffn_dim}, vocab {c.vocab_size}) needs "
                f"{list(expected)}; the file is corrupt or was converted wrongly"
            )

    def matrix(self, name: str, shape: tuple[int, int] | None = None) -> QTensor:
        """A 2-D weight as a QTensor view; `shape` (rows, cols) is what the config says it must be."""
        info = self._info(name)
        if len(info.shape) != 2:
            raise ModelFileError(f"{self.gguf.path}: tensor {name!r} has shape {info.shape}, expected 2-D")
        if shape is not None:
            self._check_shape(info, shape)
        return QTensor(name, info.qtype, (info.shape[0], info.shape[1]), self.gguf.tensor_bytes(name))

    def vector(self, name: str, length: int | None = None) -> np.ndarray:
        """A small float tensor (norm weight, bias) as a float32 array of `length` if given."""
        info = self._info(name)
        if length is not None:
            self._check_shape(info, (length,))
        if info.qtype not in _FLOAT_TYPES:
            raise ModelFileError(
                f"{self.gguf.path}: tensor {name!r} is {info.qtype.name}; expected a float type"
            )
        arr = self.gguf.tensor_array(name)
        if info.qtype == GGMLQuantizationType.BF16:
            return (arr.astype(np.uint32) << 16).view(np.float32).reshape(-1)
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)

    def _optional_vector(self, name: str, length: int) -> np.ndarray | None:
        return self.vector(name, length) if self.has(name) else None

    # -- model parts ---------------------------------------------------------------------------
    @functools.cached_property
    def token_embd(self) -> QTensor:
        # Kept: a view of the mapped file (its bytes follow any fetch), looked up every token.
        return self.matrix("token_embd.weight", (self.config.vocab_size, self.config.d_model))

    @property
    def output_norm(self) -> np.ndarray:
        return self.vector("output_norm.weight", self.config.d_model)

    @functools.cached_property
    def output(self) -> QTensor:
        """The output head; tied models reuse the token embedding."""
        if not self.has("output.weight"):
            return self.token_embd
        return self.matrix("output.weight", (self.config.vocab_size, self.config.d_model))

    def layer(self, i: int) -> LayerWeights:
        if not 0 <= i < self.config.n_layers:
            raise IndexError(f"layer {i} outside [0, {self.config.n_layers})")
        if i not in self._layers:
            p = f"blk.{i}."
            c = self.config
            d, q, kv, ffn = c.d_model, c.q_dim, c.kv_dim, c.ffn_dim
            self._layers[i] = LayerWeights(
                index=i,
                attn_norm=self.vector(p + "attn_norm.weight", d),
                attn_q=self.matrix(p + "attn_q.weight", (q, d)),
                attn_k=self.matrix(p + "attn_k.weight", (kv, d)),
                attn_v=self.matrix(p + "attn_v.weight", (kv, d)),
                attn_output=self.matrix(p + "attn_output.weight", (d, q)),
                ffn_norm=self.vector(p + "ffn_norm.weight", d),
                ffn_gate=self.matrix(p + "ffn_gate.weight", (ffn, d)),
                ffn_up=self.matrix(p + "ffn_up.weight", (ffn, d)),
                ffn_down=self.matrix(p + "ffn_down.weight", (d, ffn)),
                attn_q_bias=self._optional_vector(p + "attn_q.bias", q),
                attn_k_bias=self._optional_vector(p + "attn_k.bias", kv),
                attn_v_bias=self._optional_vector(p + "attn_v.bias", kv),
                attn_q_norm=self._optional_vector(p + "attn_q_norm.weight", c.head_dim),
                attn_k_norm=self._optional_vector(p + "attn_k_norm.weight", c.head_dim),
                post_attention_norm=self._optional_vector(p + "post_attention_norm.weight", d),
                post_ffw_norm=self._optional_vector(p + "post_ffw_norm.weight", d),
            )
        return self._layers[i]

    def forget_layers(self, layers: set[int]) -> None:
        """Drop the cached views of `layers`: built before their bytes were fetched into a
        partial file (prima.model.sparse), their copied vectors hold the file's holes."""
        for i in layers:
            self._layers.pop(i, None)

    def layer_tensor_names(self, i: int) -> list[str]:
        """Every tensor of layer `i` (for prefetch, release and residency accounting)."""
        prefix = f"blk.{i}."
        return [n for n in self.gguf.tensors if n.startswith(prefix)]

    def validate(self, layers: range | None = None) -> None:
        """Touch the metadata of every tensor the given layers (default: all) need, so a
        missing or unsupported tensor is reported at load time, not mid-generation."""
        _ = self.token_embd, self.output_norm, self.output
        for i in layers if layers is not None else range(self.config.n_layers):
            self.layer(i)


def _layer_index(name: str) -> str | None:
    """ "12" for "blk.12.attn_q.weight", None for a tensor outside the layers."""
    if not name.startswith("blk."):
        return None
    index = name[4:].split(".", 1)[0]
    return index if index.isdigit() else None
