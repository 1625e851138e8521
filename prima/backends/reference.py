"""The reference forward pass of a decoder-only transformer, one block read top to bottom.

Every architecture prima runs (llama, qwen2, qwen3, gemma3) is this code; their differences are
ModelConfig fields (biases, QK norm, Gemma's extra norms and embedding scale, sliding windows),
and weight formats are the `Ops` matmuls' business. The CPU backend runs it (with a one-call
decode block of its own that is tested equal to it bit for bit); another backend may run it
too, or compile its own graph and be held to it by the conformance tests.

Running the layers in several windows and passing the hidden states between them gives the
same bits as one pass, since each layer is the same computation either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prima.kernels import ops_reference as ops
from prima.kernels.ops_reference import QkvSplit
from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig
from prima.model.weights import LayerWeights, ModelWeights
from prima.weights.kv_cache import KVCache

try:
    from prima.kernels import ops_compiled as glue
except ImportError:  # no numba on this device: the same glue in numpy (slow, but it runs)
    from prima.kernels import ops_numpy as glue  # type: ignore[no-redef]


class Ops(Protocol):
    """The matmuls the reference pass needs; a backend supplies them for its weight formats."""

    def matmul(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n, cols); float32 (n, rows)."""
        ...

    def matmul_many(self, ws: Sequence[QTensor], x: np.ndarray) -> np.ndarray:
        """y = x @ [W0; W1; ...].T (n, sum of rows) for weights sharing `cols`."""
        ...

    def get_rows(self, w: QTensor, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` of W as float32 (len(ids), cols): the embedding lookup."""
        ...


@dataclass(frozen=True)
class BlockParams:
    """What a block needs beyond LayerWeights, gathered once per layer: projections grouped into
    merged launches (consecutive weights of one format), the small vectors as writable float32
    arrays (glue.NONE standing for an absent one; copies even of float32 norms, which the mmap
    gives read-only, so that every model calls the same compiled kernels), the RoPE frequencies
    and attention window."""

    weights: LayerWeights
    qkv_groups: tuple[tuple[QTensor, ...], ...]
    gate_up_groups: tuple[tuple[QTensor, ...], ...]
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    q_bias: np.ndarray
    k_bias: np.ndarray
    v_bias: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attention_norm: np.ndarray
    post_ffw_norm: np.ndarray
    inv_freq: np.ndarray  # (rope_dim / 2,) float64
    window: int  # 0: attends to the whole context
    qkv: QkvSplit  # the q|k|v split, holding the vectors above

    @staticmethod
    def of(lw: LayerWeights, cfg: ModelConfig) -> BlockParams:
        q_bias, k_bias, v_bias = _vec(lw.attn_q_bias), _vec(lw.attn_k_bias), _vec(lw.attn_v_bias)
        q_norm, k_norm = _vec(lw.attn_q_norm), _vec(lw.attn_k_norm)
        inv_freq = glue.rope_inv_freq(cfg.rope_dim, cfg.layer_rope_base(lw.index))
        return BlockParams(
            weights=lw,
            qkv_groups=_merge_groups((lw.attn_q, lw.attn_k, lw.attn_v)),
            gate_up_groups=_merge_groups((lw.ffn_gate, lw.ffn_up)),
            attn_norm=_vec(lw.attn_norm),
            ffn_norm=_vec(lw.ffn_norm),
            q_bias=q_bias,
            k_bias=k_bias,
            v_bias=v_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            post_attention_norm=_vec(lw.post_attention_norm),
            post_ffw_norm=_vec(lw.post_ffw_norm),
            inv_freq=inv_freq,
            window=cfg.sliding_window if cfg.is_sliding(lw.index) else 0,
            qkv=QkvSplit(
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                q_bias,
                k_bias,
                v_bias,
                q_norm,
                k_norm,
                cfg.norm_eps,
                inv_freq,
                glue.is_neox(cfg.rope_type),
            ),
        )


def embed(weights: ModelWeights, ops_: Ops, token_ids: np.ndarray) -> np.ndarray:
    """Token ids (n,) -> hidden states (n, d_model) float32 (Gemma scales them by sqrt(d))."""
    cfg = weights.config
    # get_rows checks the ids: a token of another vocabulary is an InputError naming it.
    h = ops_.get_rows(weights.token_embd, np.asarray(token_ids, dtype=np.int64))
    if cfg.embed_scale != 1.0:
        h *= np.float32(cfg.embed_scale)
    return h


def block(
    cfg: ModelConfig, p: BlockParams, ops_: Ops, x: np.ndarray, positions: np.ndarray, cache: KVCache
) -> np.ndarray:
    """One transformer block on hidden states x (n, d) of the tokens at `positions` (n,); their
    keys and values are written into `cache`, whose earlier positions the tokens attend to."""
    return block_sessions(cfg, p, ops_, x, positions, ((cache, len(positions)),))


def block_sessions(
    cfg: ModelConfig,
    p: BlockParams,
    ops_: Ops,
    x: np.ndarray,
    positions: np.ndarray,
    sessions: Sequence[tuple[KVCache, int]],
) -> np.ndarray:
    """`block` over rows of several sessions at once (continuous batching): `sessions` lists
    each one's cache and row count, in row order. Every projection reads its weights once for
    all rows; only attention is per session, over its own cache. Each row's result has the
    bits it would have alone, since every other step is computed row by row."""
    lw = p.weights
    eps = cfg.norm_eps
    # Each intermediate is dropped (del) once the next step has read it: at prefill these are
    # (n, d) to (n, 2 ffn) float32 arrays, and a block holding them all to its end was the peak
    # of a short prompt's resident memory (SmolLM2, 128 tokens: ~2 MiB more).

    # Attention: norm -> merged q|k|v -> bias, QK norm, RoPE -> cache -> attention -> out.
    xn = glue.rms_norm(x, p.attn_norm, eps)
    qkv = _project(ops_, p.qkv_groups, xn)  # (n, (H + 2 KVH) * hd)
    del xn
    q, k, v = glue.qkv_rope(qkv, p.qkv, positions)
    del qkv
    parts = []
    start = 0
    for cache, n in sessions:
        rows = slice(start, start + n)
        t = cache.store(lw.index, positions[rows], k[rows], v[rows])
        parts.append(
            glue.attention(
                q[rows], cache.k[lw.index], cache.v[lw.index], t, positions[rows], cfg.attn_scale, p.window
            )
        )
        start += n
    del q, k, v
    attn = ops_.matmul(lw.attn_output, parts[0] if len(parts) == 1 else np.concatenate(parts))
    del parts
    # Residual (after Gemma's post-attention norm), then the feed-forward's input norm.
    x, xn = glue.residual_norm(x, attn, p.post_attention_norm, p.ffn_norm, eps)
    del attn

    # Feed-forward: merged gate|up -> act(gate) * up -> down (-> Gemma's post norm) -> residual.
    gate_up = _project(ops_, p.gate_up_groups, xn)  # (n, 2 * ffn)
    del xn
    act = glue.glu_in_place(gate_up, cfg.ffn_dim, cfg.activation)  # (n, ffn), over gate_up
    del gate_up
    ffn = ops_.matmul(lw.ffn_down, act)
    del act
    x, _ = glue.residual_norm(x, ffn, p.post_ffw_norm, glue.NONE, eps)
    return x


def final_norm(weights: ModelWeights, h: np.ndarray) -> np.ndarray:
    """Hidden states (n, d) after the last layer -> the output head's input (n, d): the rows
    embeddings are pooled from (llama.cpp's `result_norm`)."""
    return ops.rms_norm(h, weights.output_norm, weights.config.norm_eps)


def output_logits(weights: ModelWeights, ops_: Ops, h: np.ndarray) -> np.ndarray:
    """Hidden states (n, d) -> logits (n, vocab) float32: the final norm and the output head."""
    return ops_.matmul(weights.output, final_norm(weights, h))


def _project(ops_: Ops, groups: tuple[tuple[QTensor, ...], ...], x: np.ndarray) -> np.ndarray:
    """x @ [W...].T over merged groups, (n, sum of rows)."""
    outs = [ops_.matmul_many(g, x) for g in groups]
    return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)


def _merge_groups(ws: tuple[QTensor, ...]) -> tuple[tuple[QTensor, ...], ...]:
    groups: list[list[QTensor]] = []
    for w in ws:
        if groups and groups[-1][0].qtype == w.qtype:
            groups[-1].append(w)
        else:
            groups.append([w])
    return tuple(tuple(g) for g in groups)


def _vec(v: np.ndarray | None) -> np.ndarray:
    return glue.NONE if v is None else np.array(v, dtype=np.float32)
