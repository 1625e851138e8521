"""Activation rows computed in groups (row_groups: a weight block unpacked once for several rows)
give each row the bits it gets alone: speculative decoding's checked drafts and batched sessions'
tokens must equal plain decoding's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.kernels import drivers
from prima.kernels import matmul as mm

from .weights import ALL_QTYPES, random_qtensor

Q = GGMLQuantizationType
INT8_QTYPES = [q for q in ALL_QTYPES if int(q) in drivers.INT8_IDS]


@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [96, 160, 288])  # block counts 3, 5, 9: odd, with and without fours
@pytest.mark.parametrize("n", [2, 3, 4, 7])  # a pair, a pair and one, a four, a four, a pair and one
def test_each_row_of_a_group_is_the_row_alone(
    qtype: GGMLQuantizationType, cols: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if qtype.name.endswith("_K"):
        cols = 256 * (cols // 96)  # a K-quant's 256-element super-blocks
    monkeypatch.setattr(mm, "FUSED_MAX_N", 8)  # every n here through the decode kernels
    w = random_qtensor(qtype, rows=23, cols=cols, seed=cols + n)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    together = mm.matmul(w, x, int8=True)
    alone = np.concatenate([mm.matmul(w, x[i : i + 1], int8=True) for i in range(n)])
    np.testing.assert_array_equal(together, alone)
