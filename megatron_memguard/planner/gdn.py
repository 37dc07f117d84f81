"""The gated delta net token mixer in the planner's time model (Qwen3-Next style linear attention layers).

A GDN layer (megatron-core 0.19.2 ssm/gated_delta_net/gdn.py, TE spec) runs, per micro-batch on one GPU:
in_proj (column-parallel, the input norm fused) to [q, k, v, z, beta, alpha]; under CP an all-to-all trading the
sequence for heads (common.py tensor_a2a_cp2hp); the short causal depthwise conv1d over q, k, v; the L2 norms of q
and k; flash-linear-attention's chunked delta-rule kernel (fla/ops/gated_delta_rule/chunk.py, chunk size 64);
the gated RMSNorm of its output; under CP the all-to-all back (tensor_a2a_hp2cp); out_proj (row-parallel). Its
TP collectives are the attention layer's (one column / row-parallel pair). Pure functions; constants documented in
docs/planner.md section 2.15.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..gpus import GpuSpec
from .kernels import memory_seconds, wave_efficiency

CHUNK = 64              # chunk_gated_delta_rule_fwd's chunk_size (flash-linear-attention 0.4.2)
# Element-wise bytes per element, forward + backward (bf16):
CONV_BYTES = 10         # depthwise conv1d + SiLU per conv channel: fwd r2 w2; bwd r2 (input) r2 (grad) w2
CONV_FWD = 4
L2NORM_BYTES = 10       # l2norm of q and k per element: fwd r2 w2; bwd r2 r2 w2 (the saved output, the grad)
L2NORM_FWD = 4
GATED_NORM_BYTES = 16   # RMSNorm(x) * SiLU(z) per value element: fwd r2 r2 w2; bwd r2 r2 r2 w2 w2
GATED_NORM_FWD = 6
# Kernels of the mixer's core beyond its GEMMs, replacing attention's core kernel and rope (3 fwd, 5 bwd in
# timing.KERNELS_*): fwd conv, 2 l2norms, g / beta, fla's cumsum, kkt, solve_tril, w/u, h, o, gated norm;
# bwd conv, 2 l2norms, g / beta, fla's w/u and h recomputes, dv_local, dhu, dqkwg, wy_bwd, cumsum, gated norm
KERNELS_FWD = 11
KERNELS_BWD = 12
ATTN_KERNELS_FWD = 3
ATTN_KERNELS_BWD = 5


def delta_rule_flops_per_token(dk: int, dv: int, chunk: int = CHUNK) -> tuple[float, float]:
    """(forward, backward) FLOPs of the chunked gated delta rule for one token of one value head, counted from
    flash-linear-attention's chunk_gated_delta_rule (each C x C block computed whole, as the kernels do):

    forward, per chunk of C tokens: A = beta K K^T (2 C^2 dk); solve_tril inverts the unit lower-triangular
    I + A (C^3 / 3 multiply-adds: 2 C^3 / 3); w = A (beta e^g K), u = A (beta V) (2 C^2 dk + 2 C^2 dv); the
    state pass v' = u - w S and S <- decay S + K^T v' (2 C dk dv each); o = Q S + (Q K^T masked) v'
    (2 C dk dv + 2 C^2 dk + 2 C^2 dv). Per token: 6 dk dv + 6 C dk + 4 C dv + 2 C^2 / 3, linear in the sequence.

    backward: two gradient GEMMs per forward GEMM (2 x forward), plus the forward's w, u and the chunk states
    that chunk_gated_delta_rule_bwd recomputes (recompute_w_u_fwd, chunk_gated_delta_rule_fwd_h):
    2 C dk + 2 C dv + 4 dk dv."""
    c = chunk
    fwd = 6.0 * dk * dv + 6.0 * c * dk + 4.0 * c * dv + 2.0 * c * c / 3.0
    return fwd, 2.0 * fwd + 2.0 * c * dk + 2.0 * c * dv + 4.0 * dk * dv


@dataclass(frozen=True)
class GdnShape:
    """The mixer's shape (TransformerConfig's linear_* fields)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def in_proj_width(self, tp: int) -> int:
        """in_proj's output per TP rank: q, k (Hk dk / t each), v, z (Hv dv / t each), beta, alpha (Hv / t)."""
        return (2 * self.key_heads * self.key_dim + 2 * self.value_heads * self.value_dim
                + 2 * self.value_heads) // tp

    def conv_channels(self, tp: int) -> int:
        """The conv runs over q, k and v: (2 Hk dk + Hv dv) / t."""
        return (2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim) // tp

    def value_width(self, tp: int) -> int:
        return self.value_heads * self.value_dim // tp

    def heads_split_ok(self, tp: int, cp: int, cp_splits_heads: bool) -> bool:
        """GatedDeltaNet splits both head counts over TP (core 0.16.1, 0.17.1: CP must be 1) or over TP x CP
        (0.18+: CP is an all-to-all of heads); TransformerConfig.__post_init__ asserts both."""
        if not cp_splits_heads and cp > 1:
            return False
        n = tp * cp if cp_splits_heads else tp
        return self.key_heads % n == 0 and self.value_heads % n == 0


def gdn_shape(L: Any) -> GdnShape:
    """The mixer's shape of a resolved layout."""
    return GdnShape(L.linear_num_key_heads, L.linear_num_value_heads, L.linear_key_head_dim,
                    L.linear_value_head_dim, L.linear_conv_kernel_dim)


@dataclass(frozen=True)
class GdnCore:
    """The GDN mixer's work between in_proj and out_proj, one micro-batch, one GPU (seconds)."""

    kernel_fwd: float
    kernel_bwd: float
    kernel_eff: float            # fraction of peak of the delta-rule kernels
    kernel_flops_fwd: float
    elem_fwd: float              # conv1d, l2norms, gated norm
    elem_bwd: float
    norm_fwd: float              # of which the gated norm's forward ('gdn_norm_out' recompute)


def gdn_core(g: GdnShape, *, b: int, seq: int, tp: int, cp: int, act_bytes: int, gpu: GpuSpec) -> GdnCore:
    """The delta-rule kernel and the element-wise kernels of one GDN mixer. A rank runs Hv / t heads over its
    b s / cp tokens, or under CP (all-to-all) Hv / (t cp) heads over the whole sequence: the same FLOPs. The
    chunk-parallel kernels (kkt, w/u, o) run one block per (sequence, head, chunk): their waves set the rate, at
    the GPU's attention efficiency (the same class of tiled Triton / CUDA kernel)."""
    heads = g.value_heads // tp                    # q and k repeated to Hv heads for the kernel
    tokens = b * seq // cp
    f_tok, b_tok = delta_rule_flops_per_token(g.key_dim, g.value_dim)
    flops_f = tokens * heads * f_tok
    blocks = b * max(1, heads // cp) * math.ceil(seq / CHUNK)
    eff = gpu.attention_efficiency * wave_efficiency(blocks, gpu.sms)
    kf = flops_f / (gpu.bf16_flops * eff)
    kb = tokens * heads * b_tok / (gpu.bf16_flops * eff)
    scale = act_bytes / 2
    qk = 2 * g.key_heads * g.key_dim // tp
    v = g.value_width(tp)
    e_all = tokens * (CONV_BYTES * g.conv_channels(tp) + L2NORM_BYTES * qk + GATED_NORM_BYTES * v) * scale
    e_fwd = tokens * (CONV_FWD * g.conv_channels(tp) + L2NORM_FWD * qk + GATED_NORM_FWD * v) * scale
    return GdnCore(kernel_fwd=kf, kernel_bwd=kb, kernel_eff=eff, kernel_flops_fwd=flops_f,
                   elem_fwd=memory_seconds(e_fwd, gpu), elem_bwd=memory_seconds(e_all - e_fwd, gpu),
                   norm_fwd=memory_seconds(tokens * GATED_NORM_FWD * v * scale, gpu))
