"""The CPU backend's one-call decode block: a layer's constants for prima.kernels.decode_layer,
gathered once per window, so decode crosses Python once per block. Its result is the reference
block's, bit for bit (tests/kernels/test_decode_layer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prima.kernels import ops_reference as ops
from prima.kernels.decode_layer import DECODE_IDS, FusedLayer, decode_layer
from prima.kernels.quants import F16_TABLE
from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig

if TYPE_CHECKING:
    from prima.backends.reference import BlockParams

# The seven projections of a block, in FusedLayer.ws's order.
PROJECTIONS: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NO_TABLE = np.empty(0, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class FusedBlock:
    """What decode_layer needs of one block, gathered once: raw weights as read-only views (numba
    compiles one variant per array type), format ids, the block's writable float32 vectors and
    q|k|v split (shared with its BlockParams), and its attention and FFN shapes."""

    layer: FusedLayer
    args: tuple  # layer.plain(), what decode_layer takes

    @staticmethod
    def build(params: BlockParams, config: ModelConfig) -> FusedBlock | None:
        """The block of `params`, or None when a projection has a format without a decode
        kernel: such blocks keep the step-by-step path."""
        tensors: list[QTensor] = [getattr(params.weights, name) for name in PROJECTIONS]
        if any(int(w.qtype) not in DECODE_IDS for w in tensors):
            return None
        ws = []
        for w in tensors:
            view = w.raw.view()
            view.flags.writeable = False
            ws.append(view)
        gelu = config.activation == "gelu"
        layer = FusedLayer(
            ws=tuple(ws),
            fmts=np.array([int(w.qtype) for w in tensors], dtype=np.int64),
            norms=(params.attn_norm, params.ffn_norm, params.post_attention_norm, params.post_ffw_norm),
            qkv=params.qkv,
            attn_scale=config.attn_scale,
            window=params.window,
            ffn_dim=config.ffn_dim,
            gelu=gelu,
            gelu_table=ops.gelu_fp16_table() if gelu else _NO_TABLE,
        )
        return FusedBlock(layer, layer.plain())

    def run(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        kv: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        t: int,
        int8: bool,
        attn_parallel_min: int,
    ) -> np.ndarray:
        return decode_layer(x, self.args, kv, t, positions, int8, F16_TABLE, attn_parallel_min)
