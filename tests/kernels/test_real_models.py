"""The kernels on real tensors of the two test models (skipped when the files are absent)."""

from __future__ import annotations

import numpy as np
import pytest

from prima.kernels import matmul as mm
from prima.kernels.tensor import QTensor
from prima.model.gguf_file import GGUFFile

from .weights import reference, relative_error

TOL = 1e-5


def _qtensor(gguf: GGUFFile, name: str) -> QTensor:
    info = gguf.tensors[name]
    return QTensor(name, info.qtype, info.shape, gguf.tensor_bytes(name))


def _check_matmul(w: QTensor) -> None:
    w_ref = reference(w)
    for n in (1, 17):
        x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
        assert relative_error(mm.matmul(w, x), x, w_ref) < TOL, (w.name, n)


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight"])
def test_smollm2_q4_1_layers(smollm2_gguf: GGUFFile, name: str) -> None:
    _check_matmul(_qtensor(smollm2_gguf, name))


@pytest.mark.parametrize(
    "name",
    [
        "blk.0.ffn_gate.weight",  # Q5_0
        "blk.0.attn_output.weight",  # Q4_K
        "blk.0.ffn_down.weight",  # Q6_K
        "blk.0.attn_v.weight",  # Q8_0
    ],
)
def test_gemma3_layers(gemma3_gguf: GGUFFile, name: str) -> None:
    _check_matmul(_qtensor(gemma3_gguf, name))


@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_token_embd_rows(model: str, request: pytest.FixtureRequest) -> None:
    w = _qtensor(request.getfixturevalue(model), "token_embd.weight")
    ids = np.array([0, 1, 2, w.rows // 2, w.rows - 1])
    sub = QTensor(w.name, w.qtype, (len(ids), w.cols), np.ascontiguousarray(w.raw[ids]))
    np.testing.assert_allclose(mm.get_rows(w, ids), reference(sub).astype(np.float32), rtol=1e-6, atol=1e-7)
