"""The CPU backend's one-call decode block: a layer's arguments for prima.kernels.decode_layer,
gathered once per window, so decode crosses Python once per block. Its result is the reference
block's, bit for bit (tests/kernels/test_decode_layer.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prima.kernels import drivers, ops_compiled
from prima.kernels import ops_reference as ops
from prima.kernels.decode_layer import decode_layer
from prima.kernels.quants import F16_TABLE
from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig
from prima.model.weights import LayerWeights

# The seven projections and the small vectors of a block, in decode_layer's argument order.
PROJECTIONS: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECTORS: tuple[str, ...] = (
    "attn_norm",
    "ffn_norm",
    "attn_q_bias",
    "attn_k_bias",
    "attn_v_bias",
    "attn_q_norm",
    "attn_k_norm",
    "post_attention_norm",
    "post_ffw_norm",
)


def _vector(v: np.ndarray | None) -> np.ndarray:
    return np.empty(0, dtype=np.float32) if v is None else np.array(v, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class FusedBlock:
    """What decode_layer needs of one block, gathered once: raw weights as read-only views (numba
    compiles one variant per array type), format ids, writable float32 vectors, RoPE table."""

    ws: tuple[np.ndarray, ...]
    fmts: np.ndarray
    vecs: tuple[np.ndarray, ...]
    inv_freq: np.ndarray
    window: int
    config: ModelConfig

    @staticmethod
    def build(
        layer: LayerWeights, config: ModelConfig, inv_freq: np.ndarray, window: int
    ) -> FusedBlock | None:
        """The block of LayerWeights `layer`, or None when a projection has a format without a
        fused kernel (float weights): those blocks keep the step-by-step path."""
        tensors: list[QTensor] = [getattr(layer, name) for name in PROJECTIONS]
        if any(int(w.qtype) not in drivers.QUANTIZED_IDS for w in tensors):
            return None
        ws = []
        for w in tensors:
            view = w.raw.view()
            view.flags.writeable = False
            ws.append(view)
        return FusedBlock(
            ws=tuple(ws),
            fmts=np.array([int(w.qtype) for w in tensors], dtype=np.int64),
            vecs=tuple(_vector(getattr(layer, name)) for name in VECTORS),
            inv_freq=inv_freq,
            window=window,
            config=config,
        )

    def run(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        kv: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        t: int,
        int8: bool,
        attn_parallel_min: int,
    ) -> np.ndarray:
        cfg = self.config
        return decode_layer(
            x,
            self.ws,
            self.fmts,
            int8,
            F16_TABLE,
            self.vecs,
            kv,
            t,
            positions,
            self.inv_freq,
            ops_compiled.is_neox(cfg.rope_type),
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.norm_eps,
            cfg.attn_scale,
            self.window,
            cfg.ffn_dim,
            cfg.activation == "gelu",
            ops.gelu_fp16_table() if cfg.activation == "gelu" else _NO_TABLE,
            attn_parallel_min,
        )


_NO_TABLE = np.empty(0, dtype=np.float32)
