"""The forward pass, split where the ring splits it: `embed` (head node), `forward_layers` over
any window `[start, end)` (every node), and `output_logits` (final norm + output head).

One code path for every architecture and weight format: formats are handled by the backend's
kernels, architectural differences by ModelConfig fields. Running the layers in several windows
and passing the hidden states between them is bit-identical to one pass, since each layer is
the same computation either way.
"""

from __future__ import annotations

import numpy as np

from prima.backends.base import Backend
from prima.kernels import ops
from prima.model.config import ModelConfig
from prima.model.weights import LayerWeights, ModelWeights
from prima.weights.kv_cache import KVCache


class Transformer:
    """A decoder-only transformer over mmap'd GGUF weights, computed by `backend`."""

    def __init__(self, weights: ModelWeights, backend: Backend) -> None:
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.backend = backend

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
        positions = np.asarray(positions, dtype=np.int64)
        for i in range(start, end):
            h = self._layer(self.weights.layer(i), h, positions, cache)
        return h

    def _layer(self, lw: LayerWeights, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        cfg = self.config
        mm = self.backend.matmul
        n = x.shape[0]

        # Attention block: norm -> q, k, v -> (QK norm) -> RoPE -> cache -> attention -> out proj.
        xn = ops.rms_norm(x, lw.attn_norm, cfg.norm_eps)
        q = mm(lw.attn_q, xn)
        k = mm(lw.attn_k, xn)
        v = mm(lw.attn_v, xn)
        if lw.attn_q_bias is not None:
            q += lw.attn_q_bias
        if lw.attn_k_bias is not None:
            k += lw.attn_k_bias
        if lw.attn_v_bias is not None:
            v += lw.attn_v_bias
        q = q.reshape(n, cfg.n_heads, cfg.head_dim)
        k = k.reshape(n, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
        if lw.attn_q_norm is not None:
            q = ops.rms_norm(q, lw.attn_q_norm, cfg.norm_eps)
        if lw.attn_k_norm is not None:
            k = ops.rms_norm(k, lw.attn_k_norm, cfg.norm_eps)
        base = cfg.layer_rope_base(lw.index)
        q = ops.rope(q, positions, base, cfg.rope_dim, cfg.rope_type)
        k = ops.rope(k, positions, base, cfg.rope_dim, cfg.rope_type)
        t = cache.store(lw.index, positions, k, v)
        window = cfg.sliding_window if cfg.is_sliding(lw.index) else 0
        attn = ops.attention(
            q, cache.k[lw.index][:t], cache.v[lw.index][:t], positions, cfg.attn_scale, window
        )
        attn = mm(lw.attn_output, attn)
        if lw.post_attention_norm is not None:
            attn = ops.rms_norm(attn, lw.post_attention_norm, cfg.norm_eps)
        x = x + attn

        # Feed-forward block: norm -> act(gate) * up -> down (-> post norm).
        xn = ops.rms_norm(x, lw.ffn_norm, cfg.norm_eps)
        gate = mm(lw.ffn_gate, xn)
        up = mm(lw.ffn_up, xn)
        act = ops.gelu(gate) if cfg.activation == "gelu" else ops.silu(gate)
        ffn = mm(lw.ffn_down, act * up)
        if lw.post_ffw_norm is not None:
            ffn = ops.rms_norm(ffn, lw.post_ffw_norm, cfg.norm_eps)
        return x + ffn

    # -- tail ----------------------------------------------------------------------------------
    def output_logits(self, h: np.ndarray) -> np.ndarray:
        """Hidden states (n, d) -> logits (n, vocab) float32 through the final norm and head."""
        hn = ops.rms_norm(h, self.weights.output_norm, self.config.norm_eps)
        return self.backend.matmul(self.weights.output, hn)

    def new_cache(self, n_ctx: int, layers: range | None = None) -> KVCache:
        return KVCache(self.config, n_ctx, layers if layers is not None else range(self.config.n_layers))
