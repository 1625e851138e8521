"""Target/draft pairs that bound what a draft model can do, made from the one small model we have.

No same-family pair of a big target and a small draft is small enough to download for a bench,
so bench_speculative.py measures the two bounds instead, both over SmolLM2's vocabulary:

- the ceiling: a target that is SmolLM2 at higher precision (its Q4_1 weights dequantized and
  written as F32 or F16), drafted for by the Q4_1 original. Same weights (F32: exactly), so
  nearly every draft is accepted, and the draft costs a fraction of the target (a third of the
  bytes read at F16, about a fifth at F32): the best a real pair can do.
- the floor: SmolLM2 drafted for by a tiny random-weight Qwen with SmolLM2's tokenizer
  (prima.model.synth). Its drafts are almost always rejected: what a useless draft costs once
  DraftLength backs off.

Both files are written once into a cache directory and reused.
"""

from __future__ import annotations

# Thread pools set up before numpy loads (prima.startup): a BLAS with threads of its own would
# contend with prima's prefill threads, which no user of the CLI sees.
import prima.startup  # noqa: F401

# isort: split

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from prima.model.synth import SynthSpec, write_synth_model

CEILING_TYPES = {
    "F32": GGMLQuantizationType.F32,
    "F16": GGMLQuantizationType.F16,
    "BF16": GGMLQuantizationType.BF16,
}
# general.file_type as llama.cpp numbers it (llama_ftype): all F32, mostly F16, mostly BF16.
_FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32}
# The floor's draft: 2 layers of 64 wide, so its cost is mostly its 49152-row output head.
FLOOR_SPEC = SynthSpec(
    arch="qwen2", n_layers=2, d_model=64, ffn=128, n_heads=4, n_kv_heads=2, qtype="Q8_0", tied_output=True
)
_WRITER_KEYS = ("GGUF.", "general.architecture", "general.file_type")  # the writer sets these


def ceiling_target(source: Path, cache_dir: Path, weight_type: str = "F32") -> Path:
    """`source` with every quantized matrix dequantized to `weight_type` (F32, F16 or BF16,
    rounded by gguf-py as llama.cpp's converter rounds); norms and other F32 tensors are copied. Written once as <stem>.<type>.gguf in `cache_dir`."""
    out = cache_dir / f"{source.stem}.dequantized-{weight_type}.gguf"
    if out.is_file():
        return out
    qtype = CEILING_TYPES[weight_type]
    reader = GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    writer = GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, writer)
    writer.add_file_type(_FILE_TYPE[weight_type])

    def target_type(tensor_type: GGMLQuantizationType) -> GGMLQuantizationType:
        # Matrices take the chosen type; what is already F32 (norms, biases) stays F32.
        return GGMLQuantizationType.F32 if tensor_type == GGMLQuantizationType.F32 else qtype

    # Shapes first (the header precedes the data), then one tensor at a time: memory stays at
    # about one dequantized tensor.
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: rows, then columns
        kind = target_type(t.tensor_type)
        nbytes = int(np.prod(shape)) * (4 if kind == GGMLQuantizationType.F32 else 2)
        byte_shape = (*shape[:-1], nbytes // max(int(np.prod(shape[:-1])), 1))
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        writer.write_tensor_data(quantize(values, target_type(t.tensor_type)).view(np.uint8))
    writer.close()
    os.replace(tmp, out)
    return out


def floor_draft(source: Path, cache_dir: Path) -> Path:
    """A tiny random-weight Qwen2 with `source`'s tokenizer (so the vocabularies match), written
    once in `cache_dir`."""
    out = cache_dir / f"tiny-random-qwen2.{source.stem}-vocab.gguf"
    if out.is_file():
        return out
    return write_synth_model(out, FLOOR_SPEC, source)


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every key of `reader` but those the writer sets itself, with its type."""
    for name, field in reader.fields.items():
        if name.startswith(_WRITER_KEYS):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            if field.types[1] == GGUFValueType.STRING:
                values: list[object] = [
                    bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data
                ]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, values)
        elif vtype == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
