"""Layers of several kinds in the planner's time model: hybrid Mamba models and heterogeneous layer configs.

A hybrid model (``--hybrid-layer-pattern``) has one symbol per layer, each layer one half of a transformer layer:
'M' a Mamba mixer, '*' attention, '-' a dense MLP, 'E' an MoE block, 'G' a gated delta net (partition.HYBRID_KINDS).
A heterogeneous layer config gives each block its own attention (or none, or a linear replacement) and its own MLP
(of its own width, or none, or a linear replacement). Both are priced here as a sum of named parts, one micro-batch
on one GPU: a norm with its residual add per half present, the token mixer's part and the MLP's part. The attention
and MoE parts are the dense model's (TimeModel.layer_cost / moe_layer), the dense MLP's is computed for the block's
own width, the Mamba mixer's below.

The Mamba mixer (megatron-core 0.16.1 ssm/mamba_mixer.py, 0.19.2 the same shapes; hybrid_layer_specs.py): in_proj
(column-parallel, the layer norm fused) to [z, x, B, C, dt] = 2 d_inner + 2 G N + H per token, split over TP; under
CP an all-to-all trading the sequence for heads (MambaContextParallel.pre_conv_ssm); the causal depthwise conv1d
(width 4) over x, B, C; mamba_ssm's chunked SSD scan (ops/triton/ssd_combined.py, chunk size --mamba-chunk-size);
the gated RMSNorm of its output with z; under CP the all-to-all back (post_conv_ssm); out_proj (row-parallel). Its TP
collectives are one column / row-parallel pair, as an attention layer's. Constants in docs/planner.md section 2.16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..gpus import GpuSpec
from .gdn import CONV_BYTES, CONV_FWD, GATED_NORM_BYTES, GATED_NORM_FWD
from .kernels import memory_seconds, wave_efficiency

D_CONV = 4              # MambaMixer's d_conv (the causal conv1d's width)
# Kernels of the Mamba mixer beyond its GEMMs, replacing attention's core kernel and rope (timing ATTN_KERNELS_*):
# fwd conv1d, chunk_cumsum, chunk_state, state_passing, bmm_chunk (C B^T), chunk_scan, gated norm; bwd conv1d,
# the recomputed cumsum / chunk_state / state_passing / bmm_chunk, chunk_scan's dx / dC / dB, dstates, ddA, gated norm
KERNELS_FWD = 7
KERNELS_BWD = 12
# One norm (fused into the next linear's input under TE, its own kernel in the local spec) and one residual add,
# half of timing.ELEM_H_BYTES / ELEM_H_FWD (a transformer layer's two norms and two adds), and their kernels
NORM_KERNELS_FWD = 2
NORM_KERNELS_BWD = 3


def ssd_flops_per_token(heads: int, head_dim: int, groups: int, state: int, chunk: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of the chunked SSD scan for one token of a whole Mamba-2 mixer (all its heads),
    counted from the state space duality algorithm (Dao & Gu, "Transformers are SSMs", ICML 2024, section 6: the
    four steps of the chunked algorithm, each Q x Q block computed whole as the kernels do). Per chunk of Q tokens,
    with H heads of P channels, state N and G groups sharing B and C:

    1. diagonal blocks: C B^T per group (2 Q^2 N), then (L o C B^T) X per head (2 Q^2 P);
    2. chunk states: B^T (decay o X) per head (2 Q N P);
    3. state passing between chunks: one decayed add of the N x P state per head (2 N P);
    4. off-diagonal output: C times the incoming state per head (2 Q N P).

    Per token: H (2 Q P + 4 N P + 2 N P / Q) + G 2 Q N; linear in the sequence.
    Backward (mamba_ssm ops/triton/ssd_combined.py _mamba_chunk_scan_combined_bwd): two gradient products per
    forward product (2 x forward), plus what it recomputes of the forward: C B^T (G 2 Q N), the chunk states and
    their passing (H (2 N P + 2 N P / Q))."""
    H, P, G, N, Q = heads, head_dim, groups, state, chunk
    fwd = H * (2.0 * Q * P + 4.0 * N * P + 2.0 * N * P / Q) + G * 2.0 * Q * N
    return fwd, 2.0 * fwd + G * 2.0 * Q * N + H * (2.0 * N * P + 2.0 * N * P / Q)


@dataclass(frozen=True)
class MambaShape:
    """The mixer's shape (TransformerConfig's mamba_* fields, resolved: heads = 2 h / head_dim unless given)."""

    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    def in_proj_width(self, tp: int) -> int:
        """in_proj's output per TP rank: z, x (d_inner / t each), B, C (G N / t each), dt (H / t)."""
        return (2 * self.d_inner + 2 * self.groups * self.state + self.heads) // tp

    def conv_channels(self, tp: int) -> int:
        """The conv1d runs over x, B and C: (d_inner + 2 G N) / t."""
        return (self.d_inner + 2 * self.groups * self.state) // tp

    def heads_split_ok(self, tp: int, cp: int) -> bool:
        """MambaMixer.__init__ (0.16.1, 0.19.2): heads and groups divide by TP; MambaContextParallel.__init__: the
        heads of a TP rank divide by CP, and its groups and CP divide one another (resolve/hybrid.py mamba)."""
        if self.heads % tp or self.groups % tp:
            return False
        if cp == 1:
            return True
        g_t = self.groups // tp
        return (self.heads // tp) % cp == 0 and (cp % g_t == 0 if g_t < cp else g_t % cp == 0)


def mamba_shape(L: Any) -> MambaShape:
    return MambaShape(L.mamba_num_heads, L.mamba_head_dim, L.mamba_num_groups, L.mamba_state_dim, L.mamba_chunk_size)


@dataclass(frozen=True)
class MambaCore:
    """The Mamba mixer's work between in_proj and out_proj, one micro-batch, one GPU (seconds)."""

    kernel_fwd: float
    kernel_bwd: float
    kernel_eff: float            # fraction of peak of the SSD kernels
    kernel_flops_fwd: float
    elem_fwd: float              # conv1d, gated norm
    elem_bwd: float


def mamba_core(m: MambaShape, *, b: int, seq: int, tp: int, cp: int, act_bytes: int, gpu: GpuSpec) -> MambaCore:
    """The SSD scan and the element-wise kernels of one Mamba mixer. A rank runs H / t heads over its b s / cp
    tokens, or under CP (all-to-all) H / (t cp) heads over the whole sequence: the same FLOPs. The chunk kernels run
    one block per (sequence, head, chunk): their waves set the rate, at the GPU's attention efficiency (the same
    class of tiled Triton kernel, as for the gated delta net, planner/gdn.py)."""
    tokens = b * seq // cp
    # per TP rank: H / t heads, G / t groups (both divide: heads_split_ok)
    f_tok, b_tok = ssd_flops_per_token(m.heads // tp, m.head_dim, max(1, m.groups // tp), m.state, m.chunk)
    blocks = b * max(1, m.heads // tp // cp) * math.ceil(seq / m.chunk)
    eff = gpu.attention_efficiency * wave_efficiency(blocks, gpu.sms)
    scale = act_bytes / 2
    di = m.d_inner // tp
    e_all = tokens * (CONV_BYTES * m.conv_channels(tp) + GATED_NORM_BYTES * di) * scale
    e_fwd = tokens * (CONV_FWD * m.conv_channels(tp) + GATED_NORM_FWD * di) * scale
    return MambaCore(kernel_fwd=tokens * f_tok / (gpu.bf16_flops * eff), kernel_bwd=tokens * b_tok / (gpu.bf16_flops * eff),
                     kernel_eff=eff, kernel_flops_fwd=tokens * f_tok,
                     elem_fwd=memory_seconds(e_fwd, gpu), elem_bwd=memory_seconds(e_all - e_fwd, gpu))


def kind_name(kind: Any) -> str:
    """A layer kind as ``memguard plan --explain`` names it: Mamba / attention / MLP / MoE / GDN layers, or a
    heterogeneous block's attention and MLP (its own width)."""
    names = {"mamba": "Mamba", "attention": "attention", "mla": "MLA", "dsa": "DSA", "dsa_shared": "DSA(shared top-k)",
             "gdn": "GDN", "linear": "linear",
             "none": "", "dense": "MLP", "moe": "MoE"}
    mixer = names.get(kind.mixer, kind.mixer) + (f"(g{kind.query_groups})" if kind.query_groups else "")
    mlp = kind.mlp.split(":", 1)
    mlp_name = names.get(mlp[0], mlp[0]) + (f"({mlp[1]})" if len(mlp) > 1 else "")
    both = "+".join(x for x in (mixer, mlp_name) if x) or "no-op"
    return both + " layers"


# LayerCost fields that add up over the parts of a layer (the efficiencies are FLOP-weighted, the flags any-of)
_EFFS = ("gemm_eff", "attn_eff")
_FLAGS = ("gdn", "ssm")


def combine(parts: list[tuple[float, Any]], peak: float) -> Any:
    """The LayerCost of a layer made of weighted parts (weight -1 takes a part out): every time, byte and kernel
    count summed; the GEMM and attention efficiencies as the parts' FLOPs over the sum's time at ``peak``."""
    first = parts[0][1]
    cls = type(first)
    out: dict[str, Any] = {}
    for f in fields(cls):
        n = f.name
        if n in _EFFS or n in _FLAGS or n == "moe_detail":
            continue
        out[n] = sum(w * getattr(p, n) for w, p in parts)
        if isinstance(getattr(first, n), int) and not isinstance(getattr(first, n), bool):
            out[n] = int(round(out[n]))
    for eff, t in (("gemm_eff", "gemm_fwd"), ("attn_eff", "attn_fwd")):
        flops = sum(w * getattr(p, eff) * getattr(p, t) for w, p in parts)
        out[eff] = flops / out[t] if out[t] > 0 else 0.0
    for n in _FLAGS:
        out[n] = any(getattr(p, n) for w, p in parts if w > 0)
    out["moe_detail"] = next((p.moe_detail for w, p in parts if w > 0 and p.moe_detail), "")
    return cls(**out)
