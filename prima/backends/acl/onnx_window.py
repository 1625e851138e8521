"""A window of layers as one ONNX graph, built with onnx's helper API straight from the GGUF
weights (no torch): the form ATC compiles into an offline model for the Ascend NPU.

The graph is the reference block (prima.backends.reference) for every layer of the window:

  inputs   hidden (n, d) f32, positions (n,) int64,
           mask (M, n, ctx + n) f32 additive (0 or MASKED; ctx past slots, then the n new
             tokens): M = 1, or 2 when the window has sliding-window layers (mask[1] is theirs),
           past_k, past_v (L, ctx, KVH, hd) f16 (or f32): the L layers' caches, packed
  outputs  hidden_out (n, d) f32, new_k, new_v (L, n, KVH, hd) f16 (or f32)

Five inputs whatever L is, because of two limits of the runtime and of ATC (docs/backends.md):
a gear is described by the full shape of every input, at most 128 dims in all, so one input per
layer's cache would stop a window at 20 layers; and ATC takes at most 4 dynamic dims per gear,
which are n, n, n and ctx + n here (a second mask input would add two more).

The KV cache is float16 by default (half the device memory of float32): keys and values are
rounded to f16 as they are stored, the new tokens' own keys too, so a token sees the same keys
in the call that writes them as in later ones. Attention's two MatMuls (QK^T, PV) run in f16
whatever the cache's dtype; its mask and softmax in f32.

The caller keeps the cache (on the device) and writes new_k/new_v into it at `positions`; which
cache slots a token may see is the mask's business, so one graph serves every position, and a
cache rolled back to an earlier length needs no clearing. Projections run in float16 (weights
dequantized to fp16, activations cast to fp16 around each MatMul: the NPU's cube unit), as do
attention's MatMuls; norms, RoPE, softmax and residuals stay float32 (ATC's mixed precision must keep them so, see
prima.backends.acl.atc). Opset 17, which ATC's ONNX parser accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prima.backends.acl.runtime import AclError
from prima.backends.reference import BlockParams
from prima.kernels import matmul as kernels
from prima.kernels.ops_reference import ROPE_NEOX
from prima.kernels.tensor import QTensor
from prima.model.config import ModelConfig
from prima.model.weights import ModelWeights

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as exc:
    raise AclError("the acl backend exports windows with onnx: pip install 'prima[acl]'") from exc

OPSET = 17
KV_DTYPES: dict[str, int] = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
IR_VERSION = 8
# A masked score: exp() of it is 0 in fp32 and fp16 alike (fp16's most negative finite value).
MASKED = float(np.finfo(np.float16).min)


INPUTS: tuple[str, ...] = ("hidden", "positions", "mask", "past_k", "past_v")
OUTPUTS: tuple[str, ...] = ("hidden_out", "new_k", "new_v")


@dataclass(frozen=True)
class WindowGraph:
    """The interface of a window graph: its inputs and outputs in order (what the acl backend
    binds device buffers to) and their shapes for n tokens; `sliding` when it takes the
    sliding-window mask too (mask[1])."""

    layers: range
    ctx: int
    d_model: int
    kv_heads: int
    head_dim: int
    sliding: bool
    inputs: tuple[str, ...] = INPUTS
    outputs: tuple[str, ...] = OUTPUTS

    @property
    def n_masks(self) -> int:
        return 2 if self.sliding else 1

    def shape(self, name: str, n: int | str) -> tuple[int | str, ...]:
        """The shape of input or output `name` for n tokens (a number, or a symbol)."""
        kv = (len(self.layers), self.ctx, self.kv_heads, self.head_dim)
        keys = "ctx_plus_n" if isinstance(n, str) else self.ctx + n  # past slots, then the new
        shapes: dict[str, tuple[int | str, ...]] = {
            "hidden": (n, self.d_model),
            "positions": (n,),
            "mask": (self.n_masks, n, keys),
            "past_k": kv,
            "past_v": kv,
            "hidden_out": (n, self.d_model),
            "new_k": (len(self.layers), n, self.kv_heads, self.head_dim),
            "new_v": (len(self.layers), n, self.kv_heads, self.head_dim),
        }
        return shapes[name]


def window_graph(cfg: ModelConfig, layers: range, ctx: int) -> WindowGraph:
    """The interface of the graph export_window builds for `layers` with `ctx` past slots."""
    sliding = any(cfg.is_sliding(i) for i in layers)
    return WindowGraph(layers, ctx, cfg.d_model, cfg.n_kv_heads, cfg.head_dim, sliding)


def window_masks(cfg: ModelConfig, graph: WindowGraph, positions: np.ndarray) -> np.ndarray:
    """The graph's mask input (M, n, ctx + n) for tokens at `positions`: the causal mask, and
    the sliding-window one after it when the window has sliding layers."""
    masks = [attention_mask(positions, graph.ctx)]
    if graph.sliding:
        masks.append(attention_mask(positions, graph.ctx, cfg.sliding_window))
    return np.stack(masks)


def export_window(
    weights: ModelWeights, layers: range, ctx: int, kv_dtype: str = "float16"
) -> onnx.ModelProto:
    """The ONNX model of `layers` with a cache of `ctx` past slots in `kv_dtype` (float16 or
    float32); n stays symbolic."""
    if kv_dtype not in KV_DTYPES:
        raise AclError(f"KV cache dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    kv_type = KV_DTYPES[kv_dtype]
    cfg = weights.config
    weights.validate(layers)
    spec = window_graph(cfg, layers, ctx)
    b = _Builder()
    types = {"positions": TensorProto.INT64, "past_k": kv_type, "past_v": kv_type}
    types |= {"new_k": kv_type, "new_v": kv_type}
    inputs = [_value(name, types.get(name, TensorProto.FLOAT), spec.shape(name, "n")) for name in spec.inputs]
    outputs = [
        _value(name, types.get(name, TensorProto.FLOAT), spec.shape(name, "n")) for name in spec.outputs
    ]
    pos_f = b.op("Cast", ["positions"], to=TensorProto.FLOAT)
    masks = [b.op("Gather", ["mask", b.const(np.array(m, np.int64))], axis=0) for m in range(spec.n_masks)]
    x = "hidden"
    new_k, new_v = [], []
    for j, i in enumerate(layers):
        params = BlockParams.of(weights.layer(i), cfg)
        past = [
            b.op("Gather", [name, b.const(np.array(j, np.int64))], axis=0) for name in ("past_k", "past_v")
        ]
        x, k, v = _block(b, cfg, params, x, pos_f, masks[1 if params.window else 0], past, kv_type)
        new_k.append(b.op("Unsqueeze", [k, b.const(np.array([0], np.int64))]))  # (1, n, KVH, hd)
        new_v.append(b.op("Unsqueeze", [v, b.const(np.array([0], np.int64))]))
    b.op("Identity", [x], out="hidden_out")
    for name, rows in (("new_k", new_k), ("new_v", new_v)):
        if len(rows) > 1:
            b.op("Concat", rows, axis=0, out=name)
        else:
            b.op("Identity", rows, out=name)
    graph = helper.make_graph(b.nodes, f"prima_window_{layers.start}_{layers.stop}", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="prima")
    model.ir_version = IR_VERSION
    return model


def attention_mask(positions: np.ndarray, ctx: int, window: int = 0) -> np.ndarray:
    """The additive mask (n, ctx + n) for tokens at contiguous `positions`: a token sees the
    past slots before positions[0] and the new tokens up to itself, within `window` if > 0."""
    pos = np.asarray(positions, dtype=np.int64)
    slots = np.concatenate([np.arange(ctx), pos])  # the position each key slot holds
    valid = np.concatenate([np.arange(ctx) < pos[0], np.ones(len(pos), dtype=bool)])
    rel = pos[:, None] - slots[None, :]
    seen = valid[None, :] & (rel >= 0)
    if window:
        seen &= rel < window
    return np.where(seen, np.float32(0.0), np.float32(MASKED)).astype(np.float32)


def _block(
    b: _Builder,
    cfg: ModelConfig,
    p: BlockParams,
    x: str,
    pos_f: str,
    mask: str,
    past: list[str],
    kv_type: int,
) -> tuple[str, str, str]:
    """One block (reference.block's steps) on x (n, d) with its cached keys and values `past`
    (ctx, KVH, hd); returns its output and its new keys and values (n, KVH, hd) in `kv_type`."""
    lw = p.weights
    eps = cfg.norm_eps
    hd, heads, kv_heads = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

    # Attention: norm -> q, k, v (+ bias) -> QK norm -> RoPE -> past|new keys -> attention -> out.
    xn = _rms_norm(b, x, lw.attn_norm, eps)
    q = _project(b, lw.attn_q, xn, p.q_bias)
    k = _project(b, lw.attn_k, xn, p.k_bias)
    v = _project(b, lw.attn_v, xn, p.v_bias)
    q = b.op("Reshape", [q, b.const(np.array([0, heads, hd], np.int64))])  # (n, H, hd)
    k = b.op("Reshape", [k, b.const(np.array([0, kv_heads, hd], np.int64))])  # (n, KVH, hd)
    v = b.op("Reshape", [v, b.const(np.array([0, kv_heads, hd], np.int64))])
    if p.q_norm.size:
        q = _rms_norm(b, q, p.q_norm, eps)
    if p.k_norm.size:
        k = _rms_norm(b, k, p.k_norm, eps)
    cos, sin = _rope_angles(b, pos_f, p.inv_freq)
    q = _rope(b, cfg, q, cos, sin)
    k = _rope(b, cfg, k, cos, sin)
    # Stored in the cache's dtype; attention sees past and new keys as the cache holds them, in
    # float16 for its MatMuls.
    new_k = b.op("Cast", [k], to=kv_type)
    new_v = b.op("Cast", [v], to=kv_type)
    keys = _as_f16(b, b.op("Concat", [past[0], new_k], axis=0), kv_type)
    values = _as_f16(b, b.op("Concat", [past[1], new_v], axis=0), kv_type)
    attn = _attention(b, cfg, q, keys, values, mask)
    attn = _project(b, lw.attn_output, attn, None)
    if p.post_attention_norm.size:
        attn = _rms_norm(b, attn, p.post_attention_norm, eps)
    x = b.op("Add", [x, attn])

    # Feed-forward: norm -> act(gate) * up -> down (-> Gemma's post norm) -> residual.
    xn = _rms_norm(b, x, lw.ffn_norm, eps)
    gate = _project(b, lw.ffn_gate, xn, None)
    up = _project(b, lw.ffn_up, xn, None)
    act = _gelu(b, gate) if cfg.activation == "gelu" else b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    ffn = _project(b, lw.ffn_down, b.op("Mul", [act, up]), None)
    if p.post_ffw_norm.size:
        ffn = _rms_norm(b, ffn, p.post_ffw_norm, eps)
    return b.op("Add", [x, ffn]), new_k, new_v


def _project(b: _Builder, w: QTensor, x: str, bias: np.ndarray | None) -> str:
    """x (n, cols) f32 @ W.T in float16 (W dequantized from its GGUF blocks), back to f32."""
    w16 = kernels.get_rows(w, np.arange(w.rows)).astype(np.float16)  # (rows, cols)
    wt = b.init(np.ascontiguousarray(w16.T), w.name)  # (cols, rows)
    y16 = b.op("MatMul", [b.op("Cast", [x], to=TensorProto.FLOAT16), wt])
    y = b.op("Cast", [y16], to=TensorProto.FLOAT)
    if bias is not None and bias.size:
        y = b.op("Add", [y, b.const(bias.astype(np.float32))])
    return y


def _as_f16(b: _Builder, x: str, dtype: int) -> str:
    return x if dtype == TensorProto.FLOAT16 else b.op("Cast", [x], to=TensorProto.FLOAT16)


def _rms_norm(b: _Builder, x: str, w: np.ndarray, eps: float) -> str:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis, in float32."""
    ms = b.op("ReduceMean", [b.op("Mul", [x, x])], axes=[-1], keepdims=1)
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])])
    return b.op("Mul", [b.op("Mul", [x, inv]), b.const(w.astype(np.float32))])


def _rope_angles(b: _Builder, pos_f: str, inv_freq: np.ndarray) -> tuple[str, str]:
    """cos, sin of positions x inv_freq, (n, 1, rope_dim / 2), shared by q and k."""
    freq = b.const(inv_freq.astype(np.float32)[None, :])
    angles = b.op("Mul", [b.op("Unsqueeze", [pos_f, b.const(np.array([1], np.int64))]), freq])
    angles = b.op("Unsqueeze", [angles, b.const(np.array([1], np.int64))])
    return b.op("Cos", [angles]), b.op("Sin", [angles])


def _rope(b: _Builder, cfg: ModelConfig, x: str, cos: str, sin: str, out: str | None = None) -> str:
    """Rotary embedding on x (n, heads, hd): NEOX rotates (i, i + rope_dim/2), NORM adjacent pairs;
    dims past rope_dim pass through."""
    half, rd, hd = cfg.rope_dim // 2, cfg.rope_dim, cfg.head_dim
    rot, rest = x, None
    if rd < hd:
        rot = b.slice(x, 0, rd)
        rest = b.slice(x, rd, hd)
    if cfg.rope_type == ROPE_NEOX:
        x0, x1 = b.slice(rot, 0, half), b.slice(rot, half, rd)
        y0 = b.op("Sub", [b.op("Mul", [x0, cos]), b.op("Mul", [x1, sin])])
        y1 = b.op("Add", [b.op("Mul", [x0, sin]), b.op("Mul", [x1, cos])])
        y = b.op("Concat", [y0, y1], axis=-1)
    else:
        pairs = b.op("Reshape", [rot, b.const(np.array([0, 0, half, 2], np.int64))])  # (n, h, half, 2)
        x0, x1 = b.slice(pairs, 0, 1), b.slice(pairs, 1, 2)
        cos4 = b.op("Unsqueeze", [cos, b.const(np.array([-1], np.int64))])
        sin4 = b.op("Unsqueeze", [sin, b.const(np.array([-1], np.int64))])
        y0 = b.op("Sub", [b.op("Mul", [x0, cos4]), b.op("Mul", [x1, sin4])])
        y1 = b.op("Add", [b.op("Mul", [x0, sin4]), b.op("Mul", [x1, cos4])])
        y = b.op("Reshape", [b.op("Concat", [y0, y1], axis=-1), b.const(np.array([0, 0, rd], np.int64))])
    if rest is not None:
        y = b.op("Concat", [y, rest], axis=-1)
    return b.op("Identity", [y], out=out) if out else y


def _attention(b: _Builder, cfg: ModelConfig, q: str, keys: str, values: str, mask: str) -> str:
    """Grouped-query attention of q (n, H, hd) f32 over keys, values (T, KVH, hd) f16 with the
    additive mask (n, T) f32; returns (n, H * hd) f32. Query heads are grouped under their KV head,
    as ops.attention. QK^T and PV are float16 MatMuls (the cube unit; both projects that run LLMs
    on a 310B do so), q scaled before it is rounded so that scores stay small; the mask, softmax
    and the output are float32."""
    kvh, group, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    q = b.op("Mul", [q, b.const(np.array(cfg.attn_scale, np.float32))])
    qg = b.op("Reshape", [q, b.const(np.array([0, kvh, group, hd], np.int64))])
    qg = b.op("Cast", [b.op("Transpose", [qg], perm=[1, 2, 0, 3])], to=TensorProto.FLOAT16)  # (KVH, G, n, hd)
    kt = b.op("Unsqueeze", [b.op("Transpose", [keys], perm=[1, 2, 0]), b.const(np.array([1], np.int64))])
    scores = b.op("Cast", [b.op("MatMul", [qg, kt])], to=TensorProto.FLOAT)  # (KVH, G, n, T)
    probs = b.op("Softmax", [b.op("Add", [scores, mask])], axis=-1)
    vt = b.op("Unsqueeze", [b.op("Transpose", [values], perm=[1, 0, 2]), b.const(np.array([1], np.int64))])
    out16 = b.op("MatMul", [b.op("Cast", [probs], to=TensorProto.FLOAT16), vt])  # (KVH, G, n, hd)
    out = b.op(
        "Transpose", [b.op("Cast", [out16], to=TensorProto.FLOAT)], perm=[2, 0, 1, 3]
    )  # (n, KVH, G, hd)
    return b.op("Reshape", [out, b.const(np.array([0, cfg.n_heads * hd], np.int64))])


def _gelu(b: _Builder, x: str) -> str:
    """GELU, tanh approximation (ggml's), from primitives: ONNX's Gelu op is newer than opset 17."""
    x3 = b.op("Mul", [b.op("Mul", [x, x]), x])
    inner = b.op("Add", [x, b.op("Mul", [x3, b.const(np.array(0.044715, np.float32))])])
    t = b.op("Tanh", [b.op("Mul", [inner, b.const(np.array(0.7978845608028654, np.float32))])])
    half_x = b.op("Mul", [x, b.const(np.array(0.5, np.float32))])
    return b.op("Mul", [half_x, b.op("Add", [t, b.const(np.array(1.0, np.float32))])])


def _value(name: str, dtype: int, shape: Sequence[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


class _Builder:
    """Collects nodes and initializers, naming every intermediate value uniquely."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        name = out or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=f"n_{name}", **attrs))
        return name

    def const(self, value: np.ndarray) -> str:
        return self.init(value, "c")

    def init(self, value: np.ndarray, hint: str) -> str:
        name = self._name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def slice(self, x: str, start: int, end: int) -> str:
        """x[..., start:end]."""
        s, e, a = (self.const(np.array([v], np.int64)) for v in (start, end, -1))
        return self.op("Slice", [x, s, e, a])
