"""Write random-weight GGUF models of a chosen shape and size, with a real tokenizer.

The case prima exists for is a model bigger than a device's memory. Real models that size are
gigabytes to download; a synthetic one with the same shape streams, pages and computes exactly
like a real one (the text it writes is meaningless), so benchmarks and tests can make one of any
size locally. The tokenizer (vocabulary, merges, special ids, chat template) is copied from a
real GGUF so prompts tokenize as usual and llama.cpp loads the file too.

Quantized blocks are written directly, not quantized from floats: random quants with one small
scale per block keep activations finite through any number of layers, and writing a gigabyte
takes seconds instead of minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from prima.errors import InputError
from prima.kernels.formats.layouts import LAYOUTS

# Block formats we can synthesize: (scale bytes as f16 pairs) d [, m] then packed quants.
_SYNTH_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
_SCALE = 0.02  # weight magnitude: keeps a residual stream of random layers bounded
MiB = 1 << 20


@dataclass(frozen=True)
class SynthSpec:
    """The shape of a synthetic llama-family model."""

    arch: str = "llama"
    n_layers: int = 24
    d_model: int = 2048
    ffn: int = 8192
    n_heads: int = 32
    n_kv_heads: int = 8
    qtype: str = "Q4_1"
    context_length: int = 2048
    tied_output: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2", "qwen3"):
            raise InputError(f"synthetic models are llama, qwen2 or qwen3, not {self.arch!r}")
        if self.qtype not in _SYNTH_TYPES:
            raise InputError(f"weight type {self.qtype!r} cannot be synthesized; use one of {_SYNTH_TYPES}")
        block = GGML_QUANT_SIZES[GGMLQuantizationType[self.qtype]][0]
        if self.n_layers < 1 or self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise InputError(
                f"bad shape: {self.n_layers} layers, d_model {self.d_model}, {self.n_heads} heads, "
                f"{self.n_kv_heads} KV heads (d_model must divide into heads, heads into KV heads)"
            )
        if self.d_model % block or self.ffn % block:
            raise InputError(f"d_model and ffn must be multiples of {block} for {self.qtype}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """The 2-D tensors of one block, name -> (rows, cols) as ggml stores them."""
        kv = self.n_kv_heads * self.head_dim
        return {
            "attn_q": (self.d_model, self.d_model),
            "attn_k": (kv, self.d_model),
            "attn_v": (kv, self.d_model),
            "attn_output": (self.d_model, self.d_model),
            "ffn_gate": (self.ffn, self.d_model),
            "ffn_up": (self.ffn, self.d_model),
            "ffn_down": (self.d_model, self.ffn),
        }

    def layer_bytes(self) -> int:
        """Bytes of one block: its matrices plus its float32 norms (and biases or QK norms)."""
        kv = self.n_kv_heads * self.head_dim
        vectors = 2 * self.d_model
        if self.arch == "qwen2":
            vectors += self.d_model + 2 * kv
        elif self.arch == "qwen3":
            vectors += 2 * self.head_dim
        return sum(_tensor_bytes(shape, self.qtype) for shape in self.layer_shapes().values()) + 4 * vectors


def spec_for_size(target_bytes: int, vocab: int, **shape: int | str | bool) -> SynthSpec:
    """The spec with `shape`'s width whose file is closest to `target_bytes` (layers vary)."""
    base = SynthSpec(**shape)  # type: ignore[arg-type]
    embed = _tensor_bytes((vocab, base.d_model), base.qtype)
    fixed = embed * (1 if base.tied_output else 2)
    n_layers = max(1, round((target_bytes - fixed) / base.layer_bytes()))
    return SynthSpec(**{**shape, "n_layers": n_layers})  # type: ignore[arg-type]


def _tensor_bytes(shape: tuple[int, int], qtype: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return shape[0] * shape[1] // block * size


def _random_tensor(rng: np.random.Generator, shape: tuple[int, int], qtype: str) -> np.ndarray:
    """Random weights of `shape` in `qtype`'s raw layout (uint8 blocks, or floats)."""
    rows, cols = shape
    if qtype in ("F32", "F16"):
        data = rng.standard_normal(shape, dtype=np.float32) * _SCALE
        return data.astype(np.float16) if qtype == "F16" else data
    layout = LAYOUTS[GGMLQuantizationType[qtype]]
    n_blocks = rows * cols // layout.elements
    raw = rng.integers(0, 256, (n_blocks, layout.nbytes), dtype=np.uint8)
    # Scales that keep the weights near _SCALE: Q8_0 is q * d with q in [-128, 127]; Q4_0
    # (q - 8) * d; Q4_1 q * d + m, centred on zero by its min.
    fields = {
        "Q8_0": {"d": _SCALE / 64},
        "Q4_0": {"d": _SCALE / 4},
        "Q4_1": {"d": _SCALE / 4, "m": -2 * _SCALE},
    }
    for name, value in fields[qtype].items():
        at = layout.offset(name)
        raw[:, at : at + 2] = np.full((n_blocks, 1), value, np.float16).view(np.uint8)
    return raw.reshape(rows, cols // layout.elements * layout.nbytes)


_TOKENIZER_SKIP = ("tokenizer.ggml.add_space_prefix",)


def _copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Copy every tokenizer.* key of `source` (vocabulary, merges, ids, template); returns the
    vocabulary size."""
    reader = GGUFReader(str(source))
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name in _TOKENIZER_SKIP:
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, values)
            if name == "tokenizer.ggml.tokens":
                vocab = len(values)
        elif vtype == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    if vocab == 0:
        raise InputError(f"{source} has no tokenizer.ggml.tokens; give a GGUF with a tokenizer")
    return vocab


def write_synth_model(
    path: str | os.PathLike[str], spec: SynthSpec, tokenizer_from: str | os.PathLike[str]
) -> Path:
    """Write `spec` as a GGUF at `path` with the tokenizer of `tokenizer_from`; returns the path.
    Tensors are generated one at a time, so memory stays at about one tensor."""
    out = Path(path)
    tmp = out.with_name(out.name + ".part")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.touch()
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror}; choose another path") from None
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(str(tmp), spec.arch)
    w.add_name(f"prima-synth-{spec.arch}-{spec.n_layers}L-{spec.d_model}-{spec.qtype}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(int(GGMLQuantizationType[spec.qtype]) if spec.qtype != "F32" else 0)
    vocab = _copy_tokenizer(w, Path(tokenizer_from))
    w.add_vocab_size(vocab)

    tensors: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (vocab, spec.d_model), spec.qtype)
    ]
    tensors.append(("output_norm.weight", (spec.d_model,), "F32"))
    if not spec.tied_output:
        tensors.append(("output.weight", (vocab, spec.d_model), spec.qtype))
    kv = spec.n_kv_heads * spec.head_dim
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        tensors.append((p + "attn_norm.weight", (spec.d_model,), "F32"))
        tensors.append((p + "ffn_norm.weight", (spec.d_model,), "F32"))
        if spec.arch == "qwen2":
            for name, n in (("attn_q.bias", spec.d_model), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                tensors.append((p + name, (n,), "F32"))
        if spec.arch == "qwen3":
            tensors.append((p + "attn_q_norm.weight", (spec.head_dim,), "F32"))
            tensors.append((p + "attn_k_norm.weight", (spec.head_dim,), "F32"))
        for name, shape in spec.layer_shapes().items():
            tensors.append((p + name + ".weight", shape, spec.qtype))

    def make(name: str, shape: tuple[int, ...], qtype: str) -> np.ndarray:
        if len(shape) == 1:
            if name.endswith(".bias"):
                return (rng.standard_normal(shape, dtype=np.float32) * _SCALE).astype(np.float32)
            return np.ones(shape, dtype=np.float32)
        return _random_tensor(rng, (shape[0], shape[1]), qtype)

    # Register shapes first (the header precedes the data), then stream each tensor out.
    for name, shape, qtype in tensors:
        qt = GGMLQuantizationType[qtype]
        dtype = np.dtype({"F32": np.float32, "F16": np.float16}.get(qtype, np.uint8))
        nbytes = int(np.prod(shape)) * 4 if len(shape) == 1 else _tensor_bytes((shape[0], shape[1]), qtype)
        w.add_tensor_info(name, _byte_shape(shape, qtype), dtype, nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype in tensors:
        w.write_tensor_data(make(name, shape, qtype))
    w.close()
    os.replace(tmp, out)
    return out


def _byte_shape(shape: tuple[int, ...], qtype: str) -> tuple[int, ...]:
    if qtype in ("F32", "F16") or len(shape) == 1:
        return shape
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return (shape[0], shape[1] // block * size)


def describe(spec: SynthSpec, vocab: int) -> str:
    embed = _tensor_bytes((vocab, spec.d_model), spec.qtype)
    total = spec.n_layers * spec.layer_bytes() + embed * (1 if spec.tied_output else 2)
    return (
        f"{spec.arch} {spec.n_layers} layers, d_model {spec.d_model}, ffn {spec.ffn}, "
        f"{spec.n_heads}/{spec.n_kv_heads} heads, {spec.qtype}: ~{total / MiB:.0f} MiB "
        f"({spec.layer_bytes() / MiB:.1f} MiB per layer)"
    )
