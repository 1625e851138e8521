"""The forward pass, split where the ring splits it: `embed` (head node), `forward_layers` over
any window `[start, end)` (every node), and `output_logits` (final norm + output head).

One code path for every architecture and weight format: formats are handled by the backend's
kernels, architectural differences by ModelConfig fields. Running the layers in several windows
and passing the hidden states between them is bit-identical to one pass, since each layer is
the same computation either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prima.backends.base import Backend
from prima.kernels import ops

try:
    from prima.kernels import fused_ops
except ImportError:  # no numba on this device: the same glue in numpy (slow, but it runs)
    from prima.kernels import glue_numpy as fused_ops  # type: ignore[no-redef]
from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig
from prima.model.weights import LayerWeights, ModelWeights
from prima.weights.kv_cache import KVCache


@dataclass(frozen=True)
class _LayerPlan:
    """What the fused layer needs beyond LayerWeights: projections grouped into merged launches
    (consecutive weights of one format) and the small vectors as writable float32 arrays, with
    fused_ops.NONE standing for an absent one."""

    qkv_groups: tuple[tuple[QTensor, ...], ...]
    gate_up_groups: tuple[tuple[QTensor, ...], ...]
    q_bias: np.ndarray
    k_bias: np.ndarray
    v_bias: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attention_norm: np.ndarray
    post_ffw_norm: np.ndarray
    inv_freq: np.ndarray  # (rope_dim / 2,) float64
    window: int  # 0: attends to the whole context
    fused: object | None  # the backend's one-call block for decode (None: step by step)


def _merge_groups(ws: tuple[QTensor, ...]) -> tuple[tuple[QTensor, ...], ...]:
    groups: list[list[QTensor]] = []
    for w in ws:
        if groups and groups[-1][0].qtype == w.qtype:
            groups[-1].append(w)
        else:
            groups.append([w])
    return tuple(tuple(g) for g in groups)


def _vec(v: np.ndarray | None) -> np.ndarray:
    return fused_ops.NONE if v is None else np.array(v, dtype=np.float32)


class Transformer:
    """A decoder-only transformer over mmap'd GGUF weights, computed by `backend`."""

    def __init__(self, weights: ModelWeights, backend: Backend) -> None:
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.backend = backend
        self._plans: dict[int, _LayerPlan] = {}

    # -- head ----------------------------------------------------------------------------------
    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Token ids (n,) -> hidden states (n, d_model) float32."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        h = self.backend.get_rows(self.weights.token_embd, ids)
        if self.config.embed_scale != 1.0:
            h = h * np.float32(self.config.embed_scale)
        return np.ascontiguousarray(h, dtype=np.float32)

    # -- layers --------------------------------------------------------------------------------
    def forward_layers(
        self, h: np.ndarray, positions: np.ndarray, start: int, end: int, cache: KVCache
    ) -> np.ndarray:
        """Run layers [start, end) on hidden states h (n, d) of tokens at `positions` (n,)."""
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        h = np.ascontiguousarray(h, dtype=np.float32)
        for i in range(start, end):
            h = self._layer(self.weights.layer(i), h, positions, cache)
        return h

    def _plan(self, lw: LayerWeights) -> _LayerPlan:
        plan = self._plans.get(lw.index)
        if plan is None:
            cfg = self.config
            inv_freq = fused_ops.rope_inv_freq(cfg.rope_dim, cfg.layer_rope_base(lw.index))
            window = cfg.sliding_window if cfg.is_sliding(lw.index) else 0
            build = getattr(self.backend, "fused_block", None)
            plan = _LayerPlan(
                qkv_groups=_merge_groups((lw.attn_q, lw.attn_k, lw.attn_v)),
                gate_up_groups=_merge_groups((lw.ffn_gate, lw.ffn_up)),
                q_bias=_vec(lw.attn_q_bias),
                k_bias=_vec(lw.attn_k_bias),
                v_bias=_vec(lw.attn_v_bias),
                q_norm=_vec(lw.attn_q_norm),
                k_norm=_vec(lw.attn_k_norm),
                post_attention_norm=_vec(lw.post_attention_norm),
                post_ffw_norm=_vec(lw.post_ffw_norm),
                inv_freq=inv_freq,
                window=window,
                fused=build(lw, cfg, inv_freq, window) if build is not None else None,
            )
            self._plans[lw.index] = plan
        return plan

    def _project(self, groups: tuple[tuple[QTensor, ...], ...], x: np.ndarray) -> np.ndarray:
        """x @ [W...].T over merged groups, (n, sum of rows)."""
        outs = [self.backend.matmul_many(g, x) for g in groups]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)

    def _layer(self, lw: LayerWeights, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        cfg = self.config
        plan = self._plan(lw)
        if plan.fused is not None and x.shape[0] <= self.backend.fused_max_tokens:
            t = cache.reserve(lw.index, positions)
            return self.backend.run_block(plan.fused, x, positions, cache.k[lw.index], cache.v[lw.index], t)
        eps = cfg.norm_eps

        # Attention block: norm -> merged q|k|v -> bias, QK norm, RoPE -> cache -> attention -> out.
        xn = fused_ops.rms_norm(x, lw.attn_norm, eps)
        qkv = self._project(plan.qkv_groups, xn)  # (n, (H + 2 KVH) * hd)
        q, k, v = fused_ops.qkv_rope(
            qkv,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            plan.q_bias,
            plan.k_bias,
            plan.v_bias,
            plan.q_norm,
            plan.k_norm,
            eps,
            positions,
            plan.inv_freq,
            fused_ops.is_neox(cfg.rope_type),
        )
        t = cache.store(lw.index, positions, k, v)
        attn = fused_ops.attention(
            q, cache.k[lw.index], cache.v[lw.index], t, positions, cfg.attn_scale, plan.window
        )
        attn = self.backend.matmul(lw.attn_output, attn)
        # Residual (after Gemma's post-attention norm), then the FFN's input norm.
        x, xn = fused_ops.residual_norm(x, attn, plan.post_attention_norm, lw.ffn_norm, eps)

        # Feed-forward block: merged gate|up -> act(gate) * up -> down (-> post norm) -> residual.
        gate_up = self._project(plan.gate_up_groups, xn)  # (n, 2 * ffn)
        ffn = self.backend.matmul(lw.ffn_down, fused_ops.glu(gate_up, cfg.ffn_dim, cfg.activation))
        x, _ = fused_ops.residual_norm(x, ffn, plan.post_ffw_norm, fused_ops.NONE, eps)
        return x

    # -- tail ----------------------------------------------------------------------------------
    def output_logits(self, h: np.ndarray) -> np.ndarray:
        """Hidden states (n, d) -> logits (n, vocab) float32 through the final norm and head."""
        hn = ops.rms_norm(h, self.weights.output_norm, self.config.norm_eps)
        return self.backend.matmul(self.weights.output, hn)

    def new_cache(self, n_ctx: int, layers: range | None = None) -> KVCache:
        return KVCache(self.config, n_ctx, layers if layers is not None else range(self.config.n_layers))
