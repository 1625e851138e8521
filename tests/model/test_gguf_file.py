"""The GGUF index: agrees with gguf-py on real files, and names the problem on bad ones."""

from __future__ import annotations

import mmap
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from prima.errors import ModelFileError, UnsupportedModelError
from prima.model.files import open_model
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from tests.tiny_models import write_tiny_model


def test_gguf_index_matches_gguf_py_on_real_model(smollm2_path: Path) -> None:
    ours = GGUFFile(smollm2_path)
    ref = GGUFReader(smollm2_path)
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.n_bytes == t.n_bytes
        assert info.offset == t.data_offset
        assert np.array_equal(
            ours.tensor_bytes(t.name).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8)
        )
    assert ours.metadata["llama.block_count"] == 30
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_gguf_truncated_file_names_the_problem(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path / "tiny.gguf")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFileError, match="truncated"):
        GGUFFile(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(ModelFileError, match="truncated"):
        GGUFFile(header_only)


def test_gguf_text_file_is_rejected(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model, just some text that is long enough\n" * 3)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(fake)


def test_gguf_missing_and_directory_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such model file"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(ModelFileError, match="directory"):
        GGUFFile(tmp_path)


def test_unknown_architecture_is_unsupported(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "odd.gguf", arch="mamba9")
    with pytest.raises(UnsupportedModelError, match="mamba9.*llama, qwen2, qwen3, gemma3"):
        ModelWeights(GGUFFile(path))


def test_unsupported_tensor_type_names_tensor(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "iq.gguf", qtype=GGMLQuantizationType.IQ4_NL)
    with pytest.raises(UnsupportedModelError, match=r"token_embd\.weight.*IQ4_NL"):
        ModelWeights(GGUFFile(path)).validate()


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "holey.gguf", omit=("blk.1.ffn_up.weight",))
    weights = ModelWeights(GGUFFile(path))
    with pytest.raises(ModelFileError, match=r"blk\.1\.ffn_up\.weight.*missing"):
        weights.validate()


def _resident_bytes_of_mapping(address: int) -> int:
    """Rss of the mapping of this process that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if not head.endswith(":"):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_header_pages_are_released_after_parsing_and_indexing(smollm2_path: Path) -> None:
    """Peak memory: the header (SmolLM2's vocabulary and merges, 1.7 MiB) is read to parse it
    and to index the vocabulary, then dropped from this process's resident pages; the strings
    still read back, refaulted from the page cache.

    How many pages a refault maps around itself is the kernel's choice (fault-around, 16 pages
    by default; 77 pages stayed resident on Linux 6.18), so the bound is half the header: what
    stays is the kernel's, what the release dropped is ours."""
    files = open_model(smollm2_path)
    gguf = files.gguf
    address = gguf.data.ctypes.data
    header = gguf.data_offset
    assert header > 1 << 20
    allowance = header // 2
    assert _resident_bytes_of_mapping(address) <= allowance
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    merges = gguf.metadata["tokenizer.ggml.merges"]
    texts = (tokens[:5], tokens[-1], merges[:3])
    tokenizer = files.tokenizer  # indexing the vocabulary reads every token string
    assert _resident_bytes_of_mapping(address) <= allowance
    assert (tokens[:5], tokens[-1], merges[:3]) == texts
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # Every header page touched, then released again: the mapping's resident bytes fall by most
    # of the header.
    assert int(np.asarray(gguf.data[:header]).sum(dtype=np.uint64)) > 0
    touched = _resident_bytes_of_mapping(address)
    assert touched >= header * 9 // 10
    assert gguf.release_header_pages() == header // mmap.PAGESIZE * mmap.PAGESIZE
    assert _resident_bytes_of_mapping(address) <= min(allowance, touched - header // 2)


def test_layers_beyond_the_block_count_are_refused(tmp_path: Path) -> None:
    """A header that claims fewer layers than the file holds (llama.block_count 3 -> 1) would
    run as a one-layer model, ignoring the rest: refused, naming the layers and the key."""
    path = write_tiny_model(tmp_path / "short.gguf", n_layers=3, block_count=1)
    with pytest.raises(
        ModelFileError, match=r"layer\(s\) 1\.\.2 but its metadata says 1 layer\(s\) \(llama.block_count\)"
    ):
        ModelWeights(GGUFFile(path))
    ModelWeights(GGUFFile(write_tiny_model(tmp_path / "whole.gguf", n_layers=3)))  # the honest file opens


def _tensor_type_field(path: Path, name: str) -> int:
    """Where the header stores tensor `name`'s type id (a u32 after its name and dims)."""
    with GGUFFile(path) as gguf:
        pos, n_tensors = gguf.tensor_info_offset, len(gguf.tensors)
        head = path.read_bytes()[: gguf.data_offset]
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", head, pos)
        found = head[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", head, pos)
        pos += 4 + 8 * n_dims
        if found == name:
            return pos
        pos += 12
    raise AssertionError(f"{name} not in {path}")


def test_a_tensor_retyped_to_a_smaller_type_is_refused(smollm2_path: Path, tmp_path: Path) -> None:
    """An F32 norm retyped BF16 in the header would be read from half its bytes, as other
    numbers: the bytes it no longer claims give it away."""
    copy = tmp_path / "retyped.gguf"
    shutil.copyfile(smollm2_path, copy)
    at = _tensor_type_field(copy, "blk.0.attn_norm.weight")
    with copy.open("r+b") as f:
        f.seek(at)
        assert struct.unpack("<I", f.read(4))[0] == GGMLQuantizationType.F32
        f.seek(at)
        f.write(struct.pack("<I", GGMLQuantizationType.BF16))
    with pytest.raises(
        ModelFileError, match=r"between tensors .blk\.0\.attn_norm\.weight.*belong to no tensor"
    ):
        GGUFFile(copy)
