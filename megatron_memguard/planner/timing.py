"""An analytic step-time model for Megatron-LM training layouts (formulas and sources in docs/planner.md).

The step time of a layout is a sum of named terms, all in seconds per optimizer step:

``compute``
    m micro-batches x the forward and backward work of the slowest pipeline stage: its transformer
    layers' GEMMs (at an efficiency that falls with the per-GPU GEMM size), fused causal attention
    and memory-bound element-wise kernels, plus the embedding on the first stage and the output
    layer and cross entropy on the last.
``recompute``
    the forward work done again in the backward: the core attention (selective) or the whole layer
    with its forward collectives (full, one layer per checkpoint).
``tp_comm``
    the exposed part of the tensor-parallel collectives of each layer (all-gather / reduce-scatter
    with sequence parallelism, all-reduce without), on NVLink inside a node, hierarchically over
    the network when the TP group spans nodes. Collectives that Megatron overlaps with a GEMM
    (the backward re-gather of sequence-parallel inputs, the dgrad reduce-scatter / all-reduce)
    count only where they outlast it.
``cp_comm``
    the exposed part of context parallelism's ring exchange of K/V blocks (and their gradients),
    each step overlapped with the attention of one block.
``pp_p2p``
    pipeline point-to-point transfers of activations and gradients (blocking in 1F1B; overlapped
    with the next chunk's compute in the interleaved schedule with --overlap-p2p-communication).
``bubble``
    pipeline fill and drain: (PP-1)/(VPP*m) of the stage's work (compute + recompute + tp_comm +
    cp_comm), Narayanan et al. 2021 section 2.2.
``dp_comm``
    the exposed part of the data-parallel gradient reduce-scatter and parameter all-gather
    (distributed optimizer) or gradient all-reduce, over the DP x CP group, overlapped with the
    backward of the last micro-batch / the forward of the first (--overlap-grad-reduce,
    --overlap-param-gather); the last bucket cannot be hidden.
``optimizer``
    the optimizer step, memory-bound: reading and writing the (sharded) fp32 state.

Model FLOPs (for MFU) follow Narayanan et al. 2021 (eq. 3) and the PaLM paper's MFU appendix:
6 FLOPs per token for every weight that multiplies an activation (all layer weights and the output
layer; not the input embedding, which is a lookup, nor norm weights) plus 12 * L * (heads * head_dim)
* s per token for the attention scores and their product with V, counted fully (no causal halving).
The time model, in contrast, charges the FLOPs the GPUs really execute: causal attention as half of
the full matrix (fused kernels skip masked blocks), the padded vocabulary, recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..units import format_bytes
from .space import Candidate, Cluster, ModelShape

# ---- constants (each documented in docs/planner.md) ----------------------------------------------
GEMM_HALF_DIM = 128          # a GEMM dimension of this size reaches half the efficiency of a huge one
ATTN_HALF_SEQ = 256          # query-block length at which fused attention reaches half its efficiency
ATTN_BWD_FLOPS = 2.5         # fused attention backward / forward FLOPs (5 vs 2 matmuls, FlashAttention-2)
HBM_EFFICIENCY = 0.80        # fraction of HBM bandwidth memory-bound kernels reach
NVLINK_EFFICIENCY = 0.80     # NCCL bus bandwidth / NVLink bandwidth
NETWORK_EFFICIENCY = 0.85    # NCCL bus bandwidth / NIC bandwidth
NVLINK_STEP_LATENCY = 3e-6   # seconds per ring step on NVLink
NETWORK_STEP_LATENCY = 8e-6  # seconds per ring step across nodes
P2P_LATENCY = 10e-6          # seconds per pipeline send/receive
# Bytes each element-wise kernel moves per element, forward + backward (bf16; scaled by act bytes / 2):
ELEM_H_BYTES = 50            # per token x hidden element per layer: 2 norms, 2 residual adds (fwd 20, bwd 30)
ELEM_H_FWD = 20
ELEM_F_BYTES_GATED = 16      # per token x ffn element: SwiGLU fwd reads 2, writes 1 (6 B); bwd 10 B
ELEM_F_FWD_GATED = 6
ELEM_F_BYTES = 12            # non-gated activation (GeLU): fwd 4 B, bwd 8 B
ELEM_F_FWD = 4
ROPE_BYTES = 8               # per q/k element: rotary embedding fwd 4 B (read + write bf16), bwd 4 B
ROPE_FWD = 4
CE_BYTES = 24                # per logit: bf16 logits, fp32 copy, max/exp/sum, gradient and its cast
OPTIMIZER_BYTES_EXTRA = 10   # per parameter beyond 2 x state: grad read twice (norm, step), param write
DDP_MIN_BUCKET = 40_000_000  # Megatron's default bucket: max(40M, 1M * DP) elements
KERNEL_GAP = 2e-6            # idle GPU time between two dependent kernels (launch and dependency latency)
KERNELS_FWD = 14             # kernels of one layer's forward (TE: norm+GEMM fused, attention, rope, act, adds)
KERNELS_BWD = 28             # and of its backward (dgrad and wgrad per GEMM, ...)


@dataclass(frozen=True)
class TimeTerm:
    name: str
    seconds: float
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": self.seconds, "detail": self.detail}


TERM_NAMES = ("compute", "recompute", "tp_comm", "cp_comm", "pp_p2p", "bubble", "dp_comm", "optimizer")


class StepTime:
    """The predicted step of one candidate: its terms (seconds), throughput and MFU."""

    __slots__ = ("candidate", "values", "details", "seconds", "model_flops_per_token", "tokens_per_step", "world",
                 "peak_flops", "critical_stage")

    def __init__(self, candidate: Candidate, values: tuple[float, ...], details: tuple[str, ...] | None,
                 model_flops_per_token: float, tokens_per_step: int, world: int, peak_flops: float,
                 critical_stage: int):
        self.candidate = candidate
        self.values = values
        self.details = details
        self.seconds = sum(values)
        self.model_flops_per_token = model_flops_per_token
        self.tokens_per_step = tokens_per_step
        self.world = world
        self.peak_flops = peak_flops
        self.critical_stage = critical_stage   # the slowest pipeline stage (whose work the step follows)

    @property
    def terms(self) -> tuple[TimeTerm, ...]:
        texts = self.details or ("",) * len(TERM_NAMES)
        return tuple(TimeTerm(n, v, t) for n, v, t in zip(TERM_NAMES, self.values, texts))

    @property
    def term_seconds(self) -> dict[str, float]:
        return dict(zip(TERM_NAMES, self.values))

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.seconds / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_step / (self.seconds * self.world * self.peak_flops)

    @property
    def dominant(self) -> TimeTerm:
        """The largest cost other than the model's own compute."""
        rest = [t for t in self.terms if t.name != "compute"]
        return max(rest, key=lambda t: t.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "model_flops_per_token": self.model_flops_per_token,
            "slowest_stage": self.critical_stage,
            "terms": self.term_seconds,
            "dominant_cost": self.dominant.name,
        }


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer, one micro-batch, one GPU (seconds)."""

    gemm_fwd: float
    gemm_bwd: float
    gemm_eff: float                # FLOP-weighted efficiency of the layer's GEMMs (fraction of peak)
    col_gemm_fwd: float            # linear_qkv + linear_fc1 forward (what overlapped collectives hide behind)
    mlp_fwd: float                 # fc1 + fc2 GEMMs and the activation (selective recompute of 'mlp')
    attn_fwd: float
    attn_bwd: float
    elem_fwd: float
    elem_bwd: float
    tp_fwd: float                  # exposed TP collectives in the forward
    tp_bwd: float                  # exposed TP collectives in the backward
    cp_fwd: float
    cp_bwd: float
    flops_fwd: float               # executed FLOPs of the forward (GEMMs + attention)

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.elem_fwd

    @property
    def bwd(self) -> float:
        return self.gemm_bwd + self.attn_bwd + self.elem_bwd


@dataclass(frozen=True)
class EndsCost:
    """Embedding (first stage) and output layer + loss (last stage), one micro-batch."""

    emb_fwd: float
    emb_bwd: float
    emb_tp: float
    out_fwd: float
    out_bwd: float
    out_tp: float


def gemm_efficiency(M: int, N: int, K: int, peak_fraction: float) -> float:
    """Achieved fraction of peak for an M x N x K GEMM: the large-GEMM efficiency of the GPU scaled
    by x / (x + GEMM_HALF_DIM) for each dimension (tile quantisation and the fixed cost of a tile
    make small dimensions expensive)."""
    h = GEMM_HALF_DIM
    return peak_fraction * (M / (M + h)) * (N / (N + h)) * (K / (K + h))


class TimeModel:
    """Step times for candidates of one model on one cluster (memoised by the fields that matter)."""

    def __init__(self, shape: ModelShape, cluster: Cluster, global_batch_size: int):
        self.shape = shape
        self.cluster = cluster
        self.gbs = global_batch_size
        g = cluster.gpu
        self.peak = g.bf16_flops
        self.hbm = g.hbm_bytes_per_s * HBM_EFFICIENCY
        self.nvlink = g.nvlink_bytes_per_s * NVLINK_EFFICIENCY
        self.net = g.network_bytes_per_s * NETWORK_EFFICIENCY
        self.domain = min(cluster.tp_domain, cluster.gpus)
        self._layer: dict[tuple, LayerCost] = {}
        self._ends: dict[tuple, EndsCost] = {}
        self._cache: dict[Candidate, StepTime] = {}
        self._params: dict[tuple, int] = {}
        s = shape
        self.flops_per_token = (6.0 * (s.num_layers * s.layer_matmul_params() + s.vocab * s.hidden)
                                + 6.0 * s.num_layers * s.heads * (s.qk_dim + s.v_dim) * s.seq_length)

    # ---- primitives ------------------------------------------------------------------------------
    def gemm(self, M: int, N: int, K: int) -> tuple[float, float]:
        """(seconds, flops) of one GEMM: compute at the size-dependent efficiency, or HBM traffic if longer."""
        flops = 2.0 * M * N * K
        t = flops / (self.peak * gemm_efficiency(M, N, K, self.cluster.gpu.gemm_efficiency))
        mem = 2.0 * (M * K + K * N + M * N) / self.hbm
        return max(t, mem), flops

    def collective(self, kind: str, nbytes: float, n: int, per_domain: int) -> float:
        """Ring collective over ``n`` ranks, ``per_domain`` of them sharing an NVLink domain: the
        NVLink part among those, then (hierarchically) the network part on 1/per_domain of the data
        per GPU, each GPU using its own NIC. ``kind``: ag | rs (one pass) or ar (two)."""
        if n <= 1:
            return 0.0
        f = 2 if kind == "ar" else 1
        k = max(1, min(n, per_domain))
        t = 0.0
        if k > 1:
            t += f * (k - 1) / k * nbytes / self.nvlink + f * (k - 1) * NVLINK_STEP_LATENCY
        nodes = n // k
        if nodes > 1:
            t += f * (nodes - 1) / nodes * (nbytes / k) / self.net + f * (nodes - 1) * NETWORK_STEP_LATENCY
        return t

    def p2p(self, nbytes: float, same_domain: bool) -> float:
        return P2P_LATENCY + nbytes / (self.nvlink if same_domain else self.net)

    # ---- where groups sit (Megatron's default rank order tp-cp-ep-dp-pp) --------------------------
    def tp_per_domain(self, tp: int) -> int:
        return min(tp, self.domain)

    def cp_per_domain(self, tp: int, cp: int) -> int:
        return max(1, min(cp, self.domain // tp)) if tp < self.domain else 1

    def dpcp_per_domain(self, tp: int, n: int) -> int:
        return max(1, min(n, self.domain // tp)) if tp < self.domain else 1

    # ---- per-layer and per-end costs ---------------------------------------------------------------
    def layer_cost(self, tp: int, cp: int, b: int, sp: bool) -> LayerCost:
        key = (tp, cp, b, sp)
        hit = self._layer.get(key)
        if hit is not None:
            return hit
        s = self.shape
        seq = s.seq_length // cp
        M = b * seq
        h, d = s.hidden, s.kv_channels
        a_t, g_t, f_t = s.heads // tp, s.kv_heads_per_rank(tp), s.ffn // tp
        fc1_n = (2 if s.gated else 1) * f_t
        if s.mla:
            # down projections (whole weights, on this rank's tokens) and up projections
            ql, kvl, qk, pe, v = s.mla
            tok = M // tp if sp else M
            parts = [self.gemm(tok, kvl + pe, h), self.gemm(M, a_t * (qk + v), kvl),
                     *((self.gemm(tok, ql, h), self.gemm(M, a_t * (qk + pe), ql)) if ql else (self.gemm(M, a_t * (qk + pe), h),))]
            qkv, fq = sum(p[0] for p in parts), sum(p[1] for p in parts)
        else:
            qkv, fq = self.gemm(M, (a_t + 2 * g_t) * d, h)
        proj, fp = self.gemm(M, h, a_t * s.v_dim)
        fc1, f1 = self.gemm(M, fc1_n, h)
        fc2, f2 = self.gemm(M, h, f_t)
        gemm_fwd = qkv + proj + fc1 + fc2
        gflops = fq + fp + f1 + f2
        eff = gflops / (gemm_fwd * self.peak)
        # causal attention: each query attends to half the keys on average (also per CP rank, whose
        # sequence chunks Megatron load-balances)
        attn_flops = 2.0 * b * seq * (s.seq_length / 2) * a_t * (s.qk_dim + s.v_dim)
        attn_eff = self.cluster.gpu.attention_efficiency * seq / (seq + ATTN_HALF_SEQ)
        attn_fwd = attn_flops / (self.peak * attn_eff)
        attn_bwd = ATTN_BWD_FLOPS * attn_fwd
        scale = s.act_bytes / 2
        tok_h = M // tp if sp else M
        ef, ef_fwd = (ELEM_F_BYTES_GATED, ELEM_F_FWD_GATED) if s.gated else (ELEM_F_BYTES, ELEM_F_FWD)
        rope_el = (M * (a_t + 1) * s.mla[3] if s.mla else M * (a_t + g_t) * d) if (s.rope or s.mla) else 0
        elem = (ELEM_H_BYTES * tok_h * h + ef * M * f_t + ROPE_BYTES * rope_el) * scale / self.hbm
        elem_fwd = (ELEM_H_FWD * tok_h * h + ef_fwd * M * f_t + ROPE_FWD * rope_el) * scale / self.hbm
        act_fwd_fc = ef_fwd * M * f_t * scale / self.hbm
        # tensor-parallel collectives on the [s/cp, b, h] activation
        tp_fwd = tp_bwd = 0.0
        if tp > 1:
            S = M * h * s.act_bytes
            k = self.tp_per_domain(tp)
            ag = self.collective("ag", S, tp, k)
            rs = self.collective("rs", S, tp, k)
            ar = self.collective("ar", S, tp, k)
            col_dgrad = qkv + fc1   # dgrad and wgrad GEMMs of the column-parallel layers ~ their forward
            if sp:
                # fwd: all-gather before linear_qkv and linear_fc1, reduce-scatter after linear_proj and
                # linear_fc2; bwd: all-gather of the row-parallel layers' output gradients (exposed),
                # re-gather of the column-parallel inputs (overlapped with their dgrad GEMM) and
                # reduce-scatter of their input gradients (overlapped with their wgrad GEMM).
                tp_fwd = 2 * ag + 2 * rs
                tp_bwd = 2 * ag + max(0.0, 2 * ag - col_dgrad) + max(0.0, 2 * rs - col_dgrad)
            else:
                # fwd: all-reduce after linear_proj and linear_fc2; bwd: all-reduce of the column-parallel
                # input gradients, overlapped with their wgrad GEMM.
                tp_fwd = 2 * ar
                tp_bwd = max(0.0, 2 * ar - col_dgrad)
        # context parallelism: ring exchange of K and V blocks (and dK, dV in the backward)
        cp_fwd = cp_bwd = 0.0
        if cp > 1:
            kv = 2 * b * seq * g_t * d * s.act_bytes
            same = self.cp_per_domain(tp, cp) >= cp
            step_f = self.p2p(kv, same)
            step_b = self.p2p(2 * kv, same)
            cp_fwd = (cp - 1) * max(0.0, step_f - attn_fwd / cp)
            cp_bwd = (cp - 1) * max(0.0, step_b - attn_bwd / cp)
        lc = LayerCost(
            gemm_fwd=gemm_fwd, gemm_bwd=2 * gemm_fwd, gemm_eff=eff, col_gemm_fwd=qkv + fc1,
            mlp_fwd=fc1 + fc2 + act_fwd_fc, attn_fwd=attn_fwd, attn_bwd=attn_bwd, elem_fwd=elem_fwd,
            elem_bwd=elem - elem_fwd, tp_fwd=tp_fwd, tp_bwd=tp_bwd, cp_fwd=cp_fwd, cp_bwd=cp_bwd,
            flops_fwd=gflops + attn_flops,
        )
        self._layer[key] = lc
        return lc

    def ends_cost(self, tp: int, cp: int, b: int, sp: bool) -> EndsCost:
        key = (tp, cp, b, sp)
        hit = self._ends.get(key)
        if hit is not None:
            return hit
        s = self.shape
        M = b * s.seq_length // cp
        h = s.hidden
        v_t = s.padded_vocab(tp) // tp
        scale = s.act_bytes / 2
        emb_fwd = 4 * M * h * scale / self.hbm            # gather rows, write the output
        emb_bwd = 12 * M * h * scale / self.hbm           # scatter-add into the (fp32) weight gradient
        out_gemm, _ = self.gemm(M, v_t, h)
        ce = CE_BYTES * M * v_t / self.hbm
        out_fwd = out_gemm + ce * 0.5
        out_bwd = 2 * out_gemm + ce * 0.5
        emb_tp = out_tp = 0.0
        if tp > 1:
            S = M * h * s.act_bytes
            k = self.tp_per_domain(tp)
            # embedding: reduce-scatter (SP) or all-reduce of the vocab-parallel lookup
            emb_tp = self.collective("rs" if sp else "ar", S, tp, k)
            # output layer: all-gather of its input (SP), reduce-scatter / all-reduce of the input gradient
            # (overlapped with the wgrad GEMM), and cross entropy's three all-reduces of [s, b] fp32
            out_tp = (self.collective("ag", S, tp, k) if sp else 0.0) + max(
                0.0, self.collective("rs" if sp else "ar", S, tp, k) - out_gemm) + 3 * self.collective(
                "ar", M * 4, tp, k)
        ec = EndsCost(emb_fwd, emb_bwd, emb_tp, out_fwd, out_bwd, out_tp)
        self._ends[key] = ec
        return ec

    def stage_params(self, c: Candidate, stage: int) -> int:
        """Parameters one rank of ``stage`` holds (before DDP padding)."""
        first, last = stage == 0, stage == c.pp - 1
        key = (c.tp, c.pp > 1, c.stage_layers[stage], first, last)
        n = self._params.get(key)
        if n is not None:
            return n
        s = self.shape
        n = c.stage_layers[stage] * s.layer_params_per_rank(c.tp)
        v_rows = s.padded_vocab(c.tp) // c.tp
        if first:
            n += v_rows * s.hidden + (s.max_positions * s.hidden if s.learned_positions else 0)
        if last:
            n += s.hidden * (2 if s.normalization == "LayerNorm" else 1)
            if s.untied or c.pp > 1:
                n += v_rows * s.hidden
        self._params[key] = n
        return n

    # ---- the step ---------------------------------------------------------------------------------
    def step_time(self, c: Candidate) -> StepTime:
        """The step time of ``c`` (numbers only; :meth:`explain` adds how each term is computed)."""
        hit = self._cache.get(c)
        if hit is not None:
            return hit
        st = self._step_time(c, False)
        self._cache[c] = st
        return st

    def explain(self, c: Candidate) -> StepTime:
        """The same step time with a sentence per term saying how it is computed."""
        return self._step_time(c, True)

    def _recompute_layer(self, lc: LayerCost, recompute: str) -> tuple[float, str]:
        if recompute == "full":
            return (lc.fwd + lc.tp_fwd + lc.cp_fwd + KERNELS_FWD * KERNEL_GAP,
                    "the whole layer's forward again, with its TP/CP communication")
        if recompute == "selective":
            mods = self.shape.recompute_modules
            t, what = 0.0, []
            if "core_attn" in mods:
                t += lc.attn_fwd + KERNEL_GAP
                what.append("core attention")
            if "mlp" in mods:
                t += lc.mlp_fwd + 3 * KERNEL_GAP
                what.append("MLP")
            if "layernorm" in mods:
                t += lc.elem_fwd * 0.4 + 2 * KERNEL_GAP
                what.append("norms")
            return t, "forward of the " + (", ".join(what) or "nothing") + " again"
        return 0.0, ""

    def _step_time(self, c: Candidate, details: bool) -> StepTime:
        s = self.shape
        lc = self.layer_cost(c.tp, c.cp, c.mbs, c.sp)
        ec = self.ends_cost(c.tp, c.cp, c.mbs, c.sp)
        rc_layer, rc_what = self._recompute_layer(lc, c.recompute)
        layer_work = lc.fwd + lc.bwd + (KERNELS_FWD + KERNELS_BWD) * KERNEL_GAP
        layer_comm_tp = lc.tp_fwd + lc.tp_bwd
        layer_comm_cp = lc.cp_fwd + lc.cp_bwd
        p, v, m = c.pp, c.vpp, c.m
        # per-micro-batch work of the first, a middle and the last stage; the slowest sets the pace
        best = None
        for i in ((0,) if p == 1 else (0, 1, p - 1) if p > 2 else (0, 1)):
            n = c.stage_layers[i]
            comp = n * layer_work
            tpc = n * layer_comm_tp
            if i == 0:
                comp += ec.emb_fwd + ec.emb_bwd
                tpc += ec.emb_tp
            if i == p - 1:
                comp += ec.out_fwd + ec.out_bwd
                tpc += ec.out_tp
            total = comp + n * (rc_layer + layer_comm_cp) + tpc
            if best is None or total > best[0] + 1e-15:
                best = (total, i, comp, n * rc_layer, tpc, n * layer_comm_cp)
        _, crit, comp, rc, tpc, cpc = best
        compute, recompute, tp_comm, cp_comm = m * comp, m * rc, m * tpc, m * cpc
        work = compute + recompute + tp_comm + cp_comm
        bubble = (p - 1) / (v * m) * work

        # pipeline point-to-point: activations forward, gradients backward, once per chunk and micro-batch
        p2p = 0.0
        p2p_detail = "no pipeline"
        if p > 1:
            nbytes = c.mbs * (s.seq_length // c.cp) * s.hidden * s.act_bytes // (c.tp if c.sp else 1)
            # Stage i holds ranks [i X, (i+1) X), X = TP x CP x DP (rank order tp-cp-ep-dp-pp): unless the whole
            # pipeline fits one NVLink domain, some stage boundary crosses it, and that transfer paces the pipeline.
            same = c.tp * c.cp * c.dp * c.pp <= self.domain
            t1 = self.p2p(nbytes, same)
            if v > 1:
                chunk = (comp + rc + tpc + cpc) / v / 3     # a chunk's forward, about a third of its work
                p2p = 2 * m * v * max(P2P_LATENCY, t1 - chunk)
                if details:
                    p2p_detail = (f"2 x {m} micro-batches x {v} chunks x max({P2P_LATENCY * 1e6:.0f} us, {t1 * 1e3:.3f} ms "
                                  f"transfer - {chunk * 1e3:.3f} ms chunk forward): {format_bytes(nbytes)} on "
                                  f"{'NVLink' if same else 'the network'}, overlapped (--overlap-p2p-communication)")
            else:
                p2p = 2 * m * t1
                if details:
                    p2p_detail = (f"2 x {m} micro-batches x {t1 * 1e3:.3f} ms: {format_bytes(nbytes)} on "
                                  f"{'NVLink' if same else 'the network'}, blocking in 1F1B")

        # data parallel: gradients reduce-scatter (+ parameters all-gather) or all-reduce over DP x CP
        n_dp = c.dp * c.cp
        dp_comm = 0.0
        dp_detail = "DP x CP = 1: nothing to reduce"
        if n_dp > 1:
            psi0 = self.stage_params(c, 0)
            k = self.dpcp_per_domain(c.tp, n_dp)
            n0 = c.stage_layers[0]
            w_b = n0 * (lc.bwd + lc.tp_bwd + lc.cp_bwd + rc_layer) + ec.emb_bwd
            w_f = n0 * (lc.fwd + lc.tp_fwd + lc.cp_fwd) + ec.emb_fwd + ec.emb_tp
            if p == 1:
                w_b += ec.out_bwd
                w_f += ec.out_fwd
            bucket = max(DDP_MIN_BUCKET, 1_000_000 * c.dp)
            tail = min(1.0, bucket / psi0)
            gbytes = psi0 * s.grad_bytes
            if c.dist_opt:
                rs = self.collective("rs", gbytes, n_dp, k)
                ag = self.collective("ag", psi0 * s.param_bytes, n_dp, k)
                dp_comm = max(rs - w_b, tail * rs) + max(ag - w_f, tail * ag)
                if details:
                    dp_detail = (f"reduce-scatter of {format_bytes(gbytes)} gradients {rs * 1e3:.1f} ms behind "
                                 f"{w_b * 1e3:.1f} ms of the last backward + all-gather of parameters {ag * 1e3:.1f} ms "
                                 f"behind {w_f * 1e3:.1f} ms of the first forward; {n_dp} ranks, {k} per NVLink domain; "
                                 f"the last bucket ({tail:.0%}) stays exposed")
            else:
                ar = self.collective("ar", gbytes, n_dp, k)
                dp_comm = max(ar - w_b, tail * ar)
                if details:
                    dp_detail = (f"all-reduce of {format_bytes(gbytes)} gradients {ar * 1e3:.1f} ms behind "
                                 f"{w_b * 1e3:.1f} ms of the last backward; {n_dp} ranks, {k} per NVLink domain; "
                                 f"the last bucket ({tail:.0%}) stays exposed")

        # optimizer step: memory-bound over the (sharded) parameters of the largest stage
        psi_max = max(self.stage_params(c, i) for i in ((0,) if p == 1 else (0, 1, p - 1) if p > 2 else (0, 1)))
        shard = max(1, n_dp // s.dist_opt_instances) if c.dist_opt else 1
        elems = psi_max / shard
        per = 2 * s.optimizer_state_bytes + OPTIMIZER_BYTES_EXTRA
        optimizer = elems * per / self.hbm

        values = (compute, recompute, tp_comm, cp_comm, p2p, bubble, dp_comm, optimizer)
        if details:
            n = c.stage_layers[crit]
            where = f"stage {crit} ({n} layers" + (", embedding" if crit == 0 else "") + (
                ", output layer and loss" if crit == p - 1 else "") + ")"
            texts = (
                f"{m} micro-batches x {comp * 1e3:.2f} ms on {where}; per layer and micro-batch: GEMMs fwd "
                f"{lc.gemm_fwd * 1e3:.3f} + bwd {lc.gemm_bwd * 1e3:.3f} ms at {lc.gemm_eff:.0%} of peak, attention "
                f"{lc.attn_fwd * 1e3:.3f} + {lc.attn_bwd * 1e3:.3f} ms, element-wise {(lc.elem_fwd + lc.elem_bwd) * 1e3:.3f} ms, "
                f"kernel gaps {(KERNELS_FWD + KERNELS_BWD) * KERNEL_GAP * 1e3:.3f} ms",
                f"{m} x {n} layers x {rc_layer * 1e3:.3f} ms: {rc_what}" if rc_layer else "no recomputation",
                (f"{m} x ({n} layers x {layer_comm_tp * 1e3:.3f} ms + embedding/output) exposed TP collectives, TP{c.tp} "
                 f"{'on NVLink' if c.tp <= self.domain else 'across nodes (hierarchical)'}"
                 + (" with sequence parallelism" if c.sp else " without sequence parallelism")) if c.tp > 1 else "TP = 1",
                f"{m} x {n} layers x {layer_comm_cp * 1e3:.3f} ms exposed K/V ring exchange" if c.cp > 1 else "CP = 1",
                p2p_detail,
                f"(PP-1)/(VPP*m) = {p - 1}/({v}*{m}) of {work:.3f} s (compute + recompute + tp_comm + cp_comm)"
                if p > 1 else "no pipeline",
                dp_detail,
                f"{elems / 1e6:,.1f}M parameters{' (a 1/' + str(shard) + ' shard)' if shard > 1 else ''} x {per:.0f} B "
                f"read and written at {self.hbm / 1e12:.2f} TB/s",
            )
        else:
            texts = None
        return StepTime(candidate=c, values=values, details=texts, model_flops_per_token=self.flops_per_token,
                        tokens_per_step=self.gbs * s.seq_length, world=self.cluster.gpus, peak_flops=self.peak,
                        critical_stage=crit)
