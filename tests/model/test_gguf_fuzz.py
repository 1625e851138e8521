"""Corrupted copies of the test models: every one either raises a PrimaError or opens with every
tensor's geometry intact. Nothing else (no ValueError, OverflowError, IndexError, no view past
the end of the file) may escape.

300 seeded corruptions: byte flips in the header (the fixed fields and first keys, the tensor
infos, anywhere before the data), truncations, and fields overwritten with edge values (0, 1,
2**31, 2**32, 2**63, 2**64 - 1, ...). The copies are sparse: the header is the model's and the
tensor data a hole of zeros, since opening never computes; each case patches the one copy and
puts its bytes back afterwards, so no model is copied per case."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from prima.errors import PrimaError
from prima.model.gguf_file import GGUFFile
from prima.model.weights import ModelWeights
from tests.conftest import run_python
from tests.model.gguf_corruptions import Corruption, Layout, apply, corruptions, layout_of, restore_sparse

SEED = 12
CASES = {"smollm2": 240, "gemma3": 60}  # gemma's 262k-token vocabulary makes each open slower


@pytest.fixture(scope="module")
def sparse_models(
    smollm2_path: Path, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Layout, bytes]]:
    """Per model: a copy with the real header and a hole for the data, its layout, its header."""
    out = {}
    for tag, src in (("smollm2", smollm2_path), ("gemma3", gemma3_path)):
        layout = layout_of(src)
        with open(src, "rb") as fh:
            header = fh.read(layout.data_offset)
        dst = tmp_path_factory.mktemp("fuzz") / f"{tag}.gguf"
        with open(dst, "wb") as fh:
            fh.write(header)
            fh.truncate(layout.size)
        out[tag] = (dst, layout, header)
    return out


def _check_open(path: Path) -> None:
    """Open as a node does (index, config, every layer's views); every tensor must then lie
    whole inside the file, its byte count what its type and shape say."""
    with GGUFFile(path) as gguf:
        ModelWeights(gguf).validate()
        spans = []
        for t in gguf.tensors.values():
            if t.n_bytes:
                block_elems, block_bytes = GGML_QUANT_SIZES[t.qtype]
                assert t.n_bytes == math.prod(t.shape) // block_elems * block_bytes, t
                assert gguf.data_offset <= t.offset, t
                assert t.offset + t.n_bytes <= gguf.file_size, t
                assert gguf.tensor_bytes(t.name).nbytes == t.n_bytes
                spans.append((t.offset, t.offset + t.n_bytes))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize(("tag", "n"), list(CASES.items()), ids=list(CASES))
def test_corrupt_models_raise_prima_errors_or_open_whole(
    sparse_models: dict[str, tuple[Path, Layout, bytes]], tag: str, n: int
) -> None:
    path, layout, header = sparse_models[tag]
    _check_open(path)  # the untouched copy opens
    rng = np.random.default_rng([SEED, len(tag)])
    outcomes = {"refused": 0, "opened": 0}
    for c in corruptions(layout, n, rng):
        apply(path, c)
        try:
            _check_open(path)
            outcomes["opened"] += 1
        except PrimaError:
            outcomes["refused"] += 1
        except Exception as exc:
            raise AssertionError(f"{tag}, {c}: {exc.__class__.__name__}: {exc}") from exc
        finally:
            restore_sparse(path, layout, header, c)
    assert outcomes["refused"] > n // 4, outcomes  # the corruptions do reach the checks
    _check_open(path)


def test_a_huge_dimension_does_not_wrap_to_a_small_tensor(
    sparse_models: dict[str, tuple[Path, Layout, bytes]],
) -> None:
    """ne[0] = 2**63 on a tensor that had 576: as int64 the product wraps; it must be refused."""
    path, layout, header = sparse_models["smollm2"]
    pos, _ = layout.fields[1]  # the first tensor's ne[0]
    c = Corruption("field", pos, (2**63).to_bytes(8, "little"))
    apply(path, c)
    try:
        with pytest.raises(PrimaError, match="would end at byte"):
            GGUFFile(path)
    finally:
        restore_sparse(path, layout, header, c)


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, 2**40, 2**26 + 1])
def test_a_huge_vocabulary_string_length_is_refused(
    sparse_models: dict[str, tuple[Path, Layout, bytes]], length: int
) -> None:
    path, layout, header = sparse_models["smollm2"]
    key = b"tokenizer.ggml.tokens"
    pos = header.index(key) + len(key) + 4 + 4 + 8  # value type, item type, count: the first length
    c = Corruption("field", pos, length.to_bytes(8, "little"))
    apply(path, c)
    try:
        with pytest.raises(PrimaError):
            GGUFFile(path)
    finally:
        restore_sparse(path, layout, header, c)


@pytest.mark.parametrize("count", [2**31, 2**29, 2**24])
def test_a_huge_string_array_count_is_refused_before_anything_is_allocated(
    sparse_models: dict[str, tuple[Path, Layout, bytes]], count: int
) -> None:
    """Each claimed string needs 8 bytes of length at least: a count the rest of the header
    cannot hold is refused at once (2**31 merges once made the loader allocate 16 GiB)."""
    path, layout, header = sparse_models["smollm2"]
    key = b"tokenizer.ggml.merges"
    pos = header.index(key) + len(key) + 4 + 4  # value type, item type: the count
    c = Corruption("field", pos, count.to_bytes(8, "little"))
    apply(path, c)
    try:
        # VmHWM, not ru_maxrss: Linux carries a forking parent's peak (a test run's GiBs) into
        # its child's ru_maxrss; VmHWM belongs to the child's own address space.
        code = (
            "import re, sys\n"
            "from pathlib import Path\n"
            "from prima.errors import ModelFileError\n"
            "from prima.model.gguf_file import GGUFFile\n"
            "try:\n"
            "    GGUFFile(sys.argv[1])\n"
            "except ModelFileError as exc:\n"
            "    print(exc)\n"
            "status = Path('/proc/self/status').read_text()\n"
            "print(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
        )
        message, peak_kib = run_python(code, str(path), timeout=60).stdout.strip().splitlines()
        assert "truncated" in message
        assert int(peak_kib) < 512 * 1024  # the process's peak, far below a per-string allocation
    finally:
        restore_sparse(path, layout, header, c)
