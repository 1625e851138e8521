"""Every quant format's block layout, in one module without numba: the format modules take
theirs from here (beside their kernels), and code that writes blocks on a device without numba
(prima.model.synth) reads the same offsets instead of repeating them."""

from __future__ import annotations

from prima.ggml_constants import GGMLQuantizationType as Q
from prima.kernels.formats import F16, Layout

Q4_0 = Layout.of(Q.Q4_0, d=F16, qs=16)
Q4_1 = Layout.of(Q.Q4_1, d=F16, m=F16, qs=16)
Q5_0 = Layout.of(Q.Q5_0, d=F16, qh=4, qs=16)
Q5_1 = Layout.of(Q.Q5_1, d=F16, m=F16, qh=4, qs=16)
Q8_0 = Layout.of(Q.Q8_0, d=F16, qs=32)
Q2_K = Layout.of(Q.Q2_K, scales=16, qs=64, d=F16, dmin=F16)
Q3_K = Layout.of(Q.Q3_K, hmask=32, qs=64, scales=12, d=F16)
Q4_K = Layout.of(Q.Q4_K, d=F16, dmin=F16, scales=12, qs=128)
Q5_K = Layout.of(Q.Q5_K, d=F16, dmin=F16, scales=12, qh=32, qs=128)
Q6_K = Layout.of(Q.Q6_K, ql=128, qh=64, scales=16, d=F16)

LAYOUTS: dict[Q, Layout] = {
    layout.qtype: layout for layout in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
}
