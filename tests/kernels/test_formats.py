"""The table of quantized formats: layouts agree with gguf-py, and the dispatch, the supported
types and the int8 set are all read from it. That the kernels compute each format correctly is
test_matmul's and test_int8_dots' job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit

from prima.kernels import dispatch, drivers, formats, quants
from prima.kernels.formats import F16, Layout

Q = GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("qtype", formats.QTYPES, ids=lambda q: q.name)
def test_each_format_module_describes_its_own_type(qtype: GGMLQuantizationType) -> None:
    entry = formats.load()[qtype]
    assert entry.qtype == qtype
    assert (entry.layout.elements, entry.layout.nbytes) == GGML_QUANT_SIZES[qtype]
    assert formats.module_name(qtype).endswith("." + qtype.name.lower())


def test_layout_offsets_follow_the_fields() -> None:
    layout = Layout.of(Q.Q4_1, d=F16, m=F16, qs=16)
    assert [layout.offset(f) for f in ("d", "m", "qs")] == [0, 2, 4]
    assert layout.f16_offsets == (0, 2)
    with pytest.raises(KeyError, match="no field 'qh'"):
        layout.offset("qh")


def test_layout_that_disagrees_with_ggml_fails_at_once() -> None:
    with pytest.raises(ValueError, match="Q4_0 fields fill 17 bytes; gguf-py's block has 18"):
        Layout.of(Q.Q4_0, d=F16, qs=15)


def test_supported_types_and_dispatch_ids_come_from_the_table() -> None:
    table = formats.load()
    assert quants.SUPPORTED_QTYPES == quants.FLOAT_QTYPES | set(formats.QTYPES)
    assert drivers.QUANTIZED_IDS == {int(q) for q in table}
    assert drivers.INT8_IDS == {int(q) for q, f in table.items() if f.qdot is not None}
    for fmt in range(max(drivers.QUANTIZED_IDS) + 2):
        assert drivers.has_int8(fmt) == (fmt in drivers.INT8_IDS)


@njit(cache=False)
def _write_one(out: np.ndarray) -> None:
    out[0] = 1.0


@njit(cache=False)
def _write_two(out: np.ndarray) -> None:
    out[0] = 2.0


@njit(cache=False)
def _write_three(out: np.ndarray) -> None:
    out[0] = 3.0


def test_switch_calls_the_kernel_of_the_format_id() -> None:
    kernels = [(Q.Q4_0, _write_one), (Q.Q8_0, _write_two), (Q.Q6_K, _write_three)]
    probe = dispatch.switch("probe", ("out",), kernels)
    for qtype, value in ((Q.Q4_0, 1.0), (Q.Q8_0, 2.0), (Q.Q6_K, 3.0)):
        out = np.zeros(1, np.float32)
        probe(int(qtype), out)
        assert out[0] == value


def test_formats_are_listed_without_numba() -> None:
    """A device without numba checks the same types (and runs them on gguf-py)."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "from gguf import GGMLQuantizationType as Q\n"
        "from prima.kernels import quants\n"
        "assert Q.Q4_K in quants.SUPPORTED_QTYPES and 'numba' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
