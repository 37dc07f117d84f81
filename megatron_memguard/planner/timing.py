"""An analytic step-time model for Megatron-LM training layouts (formulas and sources in docs/planner.md).

The step time of a layout is a sum of named terms, all in seconds per optimizer step, for the slowest
pipeline stage (m micro-batches of its forward and backward):

``gemm``
    the transformer layers' and the output layer's GEMMs (forward, input-gradient and weight-gradient),
    each at an efficiency set by its per-GPU shape (:mod:`.kernels`: waves of output tiles on the SMs,
    the length of the reduction).
``attention``
    fused causal attention (FlashAttention / cuDNN), forward and backward; with context parallelism one
    kernel per step of the K/V ring, on the step's blocks (shorter blocks, fewer query tiles: slower).
``elementwise``
    memory-bound kernels: norms, residual adds, rotary embedding, the gated activation, the cross
    entropy, the embedding, and the merges of partial attention results a context-parallel ring makes.
``kernel_gaps``
    the idle GPU time between dependent kernels, per kernel launched.
``input``
    Megatron's ``get_batch`` on the first and last stages: the micro-batch copied from pinned host
    memory to TP rank 0 and broadcast to the other TP ranks, on the compute stream (the next kernels
    wait for it); with ``--create-attention-mask-in-dataloader`` (the default) that includes a
    [b, 1, s, s] bool mask of s^2 bytes per sequence, whole on every context-parallel rank.
``recompute``
    the forward work done again in the backward: the core attention (selective) or the whole layer
    with its forward collectives (full, one layer per checkpoint).
``tp_comm``
    the exposed part of the tensor-parallel collectives (all-gather / reduce-scatter with sequence
    parallelism, all-reduce without); those Megatron overlaps with a GEMM count only where they outlast it.
``cp_comm``
    the exposed part of the context-parallel ring's K/V (and dK/dV) transfers, each overlapped with the
    attention of one ring step.
``pp_p2p``
    pipeline point-to-point transfers (blocking in 1F1B; overlapped with the next chunk in the
    interleaved schedule with --overlap-p2p-communication), and those of the fill and drain, which
    nothing hides.
``bubble``
    pipeline fill and drain: the other ranks' work for one micro-batch / VPP (every rank timed from the
    layers it holds; Alpa, Zheng et al. 2022, section 5.2; with equal ranks Narayanan et al. 2021's
    (PP-1)/(VPP*m) of the stage's work).
``dp_comm``
    the exposed part of the data-parallel gradient reduce-scatter and parameter all-gather (distributed
    optimizer) or gradient all-reduce over the DP x CP group, overlapped with the backward of the last
    micro-batch / the forward of the first; the last bucket cannot be hidden.
``optimizer``
    the optimizer step, memory-bound: reading and writing the (sharded) fp32 state.

``ep_comm`` (mixture-of-experts models only)
    the token dispatch of every MoE layer (:mod:`.moe`): the all-to-alls over EP (and the ETP
    all-gather / reduce-scatter) or the all-gather / reduce-scatter over ETP x EP, forward and
    backward, on the critical path (Megatron overlaps them only with --overlap-moe-expert-parallel-comm).

There is one term per kind of communication (tp_comm, cp_comm, ep_comm, pp_p2p, dp_comm). Every term is
a pure function of the model shape, the candidate layout and the GPU's numbers. In an MoE layer the
dense MLP's GEMMs are replaced by the router's, the local experts' (grouped or one per expert, each
at the efficiency of its per-expert shape) and the shared expert's; the expert gradients are reduced
and the expert optimizer state sharded over the expert-data-parallel group.

Model FLOPs (for MFU) follow Narayanan et al. 2021 (eq. 3) and the PaLM paper's MFU appendix: 6 FLOPs
per token for every weight that multiplies an activation (all layer weights and the output layer, in
MoE layers the router, top-k experts and shared expert; not
the input embedding, which is a lookup, nor norm weights) plus 12 * L * (heads * head_dim) * s per token
for the attention scores and their product with V, counted fully (no causal halving). The time model,
in contrast, charges the FLOPs the GPUs really execute: causal attention as half of the full matrix
(fused kernels skip masked blocks), the padded vocabulary, recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..units import format_bytes
from ..estimator.layers import mixer_recipe
from ..partition import uniform_kind
from .comm import HOST_LINK_EFFICIENCY, P2P_LATENCY, collective_seconds, host_copy_seconds, p2p_seconds
from .kernels import HBM_EFFICIENCY, attention_seconds, gemm_seconds, memory_seconds
from .gdn import ATTN_KERNELS_BWD, ATTN_KERNELS_FWD, KERNELS_BWD as GDN_KERNELS_BWD, KERNELS_FWD as GDN_KERNELS_FWD
from .gdn import gdn_core, gdn_shape
from . import hybrid as hyb
from .moe import (MoeLayerCost, all_to_all_seconds, edp_per_domain, expert_params_per_rank, moe_layer_cost)
from .space import Candidate, Cluster, ModelShape

# ---- constants (each documented in docs/planner.md) ----------------------------------------------
# Bytes each element-wise kernel moves per element, forward + backward (bf16; scaled by act bytes / 2):
ELEM_H_BYTES = 50            # per token x hidden element per layer: 2 norms, 2 residual adds (fwd 20, bwd 30)
ELEM_H_FWD = 20
ELEM_F_BYTES_GATED = 16      # per token x ffn element: SwiGLU fwd reads 2, writes 1 (6 B); bwd 10 B
ELEM_F_FWD_GATED = 6
ELEM_F_BYTES = 12            # non-gated activation (GeLU): fwd 4 B, bwd 8 B
ELEM_F_FWD = 4
ROPE_BYTES = 8               # per q/k element: rotary embedding fwd 4 B (read + write bf16), bwd 4 B
ROPE_FWD = 4
# Per logit, Megatron's vocab-parallel cross entropy (tensor_parallel/cross_entropy.py, unfused, fp32): forward
# cast to fp32 (r2 w4), max (r4), subtract the max (r4 w4), exp (r4 w4), sum (r4), divide (r4 w4): 38 B;
# backward scale the kept softmax by the loss gradient (r4 w4) and cast it to bf16 (r4 w2): 14 B.
CE_BYTES = 52
# --cross-entropy-loss-fusion (megatron/core/fusions/fused_cross_entropy.py): the cast with the max (r2 w4 r4),
# exp and sum in one pass (r4 w4), the gradient in one pass to bf16 (r4 w2).
CE_BYTES_FUSED = 24
CP_MERGE_BYTES = 10          # per attention-output element and ring step: read the step's output (2 B),
#                              read and write the fp32 running output (4 + 4 B)
CP_GRAD_BYTES = 10           # per dQ / dK / dV element and ring step: add the step's gradient into fp32 (2 + 4 + 4 B)
OPTIMIZER_BYTES_EXTRA = 10   # per parameter beyond 2 x state: grad read twice (norm, step), param write
DDP_MIN_BUCKET = 40_000_000  # Megatron's default bucket: max(40M, 1M * DP) elements
# The input embedding's weight gradient is dense (F.embedding, sparse=False: PyTorch's embedding_dense_backward
# zero-fills a [V/t, h] gradient in the parameter dtype), and Megatron's DDP hook adds it into the main_grad
# buffer every micro-batch (param.main_grad.add_(param.grad)): per vocabulary element, zero-fill 1 x param
# bytes, then read the gradient (param bytes) and read and write main_grad (2 x grad bytes).
# Per token of a micro-batch on the GPU, the batch tensors get_batch moves besides the mask: tokens, labels,
# position ids (int64) and the loss mask (fp32).
BATCH_BYTES_PER_TOKEN = 8 + 8 + 8 + 4
KERNEL_GAP = 2e-6            # idle GPU time between two dependent kernels (launch and dependency latency)
KERNELS_FWD = 14             # kernels of one layer's forward (TE: norm+GEMM fused, attention, rope, act, adds)
KERNELS_BWD = 28             # and of its backward (dgrad and wgrad per GEMM, ...)
CP_KERNELS_FWD = 4           # kernels per extra ring step: attention, merge (3 element-wise) ...
CP_KERNELS_BWD = 6           # ... and in the backward: attention (3: pre, main, post), dQ and dK/dV adds, copy
MLP_KERNELS_FWD = 4          # of KERNELS_FWD, the dense MLP's (fc1, activation, fc2, bias/residual); an MoE layer
MLP_KERNELS_BWD = 8          # replaces them by its own (planner/moe.py)
# One MTP depth beyond its transformer layer (MultiTokenPredictionLayer): enorm, hnorm and final_layernorm, a norm
# 4 B forward (r2 w2) and 6 B backward (r2 r2 w2) per element as in ELEM_H_BYTES; torch.cat of the two normed
# [rows, h] halves, 4 B per h element each (r2 w2): 3 x 10 + 2 x 4 = 38 B per token x hidden element.
MTP_ELEM_BYTES = 38
# its kernels beyond the layer's: embedding (1 fwd, 2 bwd), 3 norms (3 + 3), cat (1 + 1), eh_proj (1 + 2),
# output layer and loss (6, as on the last stage)
MTP_KERNELS = 20 + 6

TERM_NAMES = ("gemm", "attention", "elementwise", "kernel_gaps", "input", "recompute", "tp_comm", "cp_comm", "pp_p2p",
              "bubble", "dp_comm", "optimizer")
# mixture-of-experts models: the expert-parallel token dispatch after the other per-layer communication
TERM_NAMES_MOE = TERM_NAMES[:8] + ("ep_comm",) + TERM_NAMES[8:]
_WORK_TERMS = ("gemm", "attention", "elementwise", "kernel_gaps")    # the model's own work on one GPU


@dataclass(frozen=True)
class TimeTerm:
    name: str
    seconds: float
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": self.seconds, "detail": self.detail}


class StepTime:
    """The predicted step of one candidate: its terms (seconds), throughput and MFU."""

    __slots__ = ("candidate", "values", "details", "seconds", "model_flops_per_token", "tokens_per_step", "world",
                 "peak_flops", "critical_stage", "names", "stage_seconds")

    def __init__(self, candidate: Candidate, values: tuple[float, ...], details: tuple[str, ...] | None,
                 model_flops_per_token: float, tokens_per_step: int, world: int, peak_flops: float,
                 critical_stage: int, names: tuple[str, ...] = TERM_NAMES, stage_seconds: tuple[float, ...] = ()):
        self.names = names
        # one micro-batch's forward and backward on each pipeline rank (all its chunks), seconds
        self.stage_seconds = stage_seconds
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
        texts = self.details or ("",) * len(self.names)
        return tuple(TimeTerm(n, v, t) for n, v, t in zip(self.names, self.values, texts))

    @property
    def term_seconds(self) -> dict[str, float]:
        return dict(zip(self.names, self.values))

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.seconds / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_step / (self.seconds * self.world * self.peak_flops)

    @property
    def dominant(self) -> TimeTerm:
        """The largest cost beyond the model's own math (GEMMs, attention, element-wise kernels)."""
        rest = [t for t in self.terms if t.name not in ("gemm", "attention", "elementwise")]
        return max(rest, key=lambda t: t.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "model_flops_per_token": self.model_flops_per_token,
            "slowest_stage": self.critical_stage,
            "stage_seconds_per_micro_batch": list(self.stage_seconds),
            "terms": self.term_seconds,
            "dominant_cost": self.dominant.name,
        }


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer, one micro-batch, one GPU (seconds)."""

    gemm_fwd: float
    gemm_bwd: float                # input-gradient + weight-gradient GEMMs
    gemm_eff: float                # FLOP-weighted efficiency of the layer's forward GEMMs (fraction of peak)
    col_dgrad: float               # linear_qkv + linear_fc1 input-gradient GEMMs (what overlapped collectives hide behind)
    col_wgrad: float               # and their weight-gradient GEMMs
    mlp_fwd: float                 # fc1 + fc2 GEMMs and the activation (selective recompute of 'mlp')
    attn_fwd: float
    attn_bwd: float
    attn_eff: float                # efficiency of the attention kernels (fraction of peak)
    elem_fwd: float                # element-wise kernels, including context-parallel merges
    elem_bwd: float
    cp_merge_fwd: float            # of which the merges of the ring's partial outputs (forward)
    kernels_fwd: int               # kernels launched (for the gaps between them)
    kernels_bwd: int
    tp_fwd: float                  # exposed TP collectives in the forward
    tp_bwd: float                  # exposed TP collectives in the backward
    cp_fwd: float
    cp_bwd: float
    flops_fwd: float               # executed FLOPs of the forward (GEMMs + attention)
    moe_fwd: float = 0.0           # an MoE layer: its MoE block's forward without the dispatch (recompute 'moe')
    ep_fwd: float = 0.0            # an MoE layer: exposed token dispatch + combine, forward
    ep_bwd: float = 0.0            # and backward
    moe_detail: str = ""
    gdn: bool = False              # a gated delta net mixer (attn_*: its delta-rule kernel; cp_*: its all-to-alls)
    gdn_norm_fwd: float = 0.0      # its gated output norm's forward (selective recompute of 'gdn_norm_out')
    ssm: bool = False              # a Mamba mixer (attn_*: its SSD scan; cp_*: its all-to-alls): no core_attention

    @property
    def per_layer(self) -> tuple[float, float, float, float, float]:
        """(gemm, attention, elementwise, kernel gaps, exposed TP) of the layer's forward and backward."""
        return (self.gemm_fwd + self.gemm_bwd, self.attn_fwd + self.attn_bwd, self.elem_fwd + self.elem_bwd,
                (self.kernels_fwd + self.kernels_bwd) * KERNEL_GAP, self.tp_fwd + self.tp_bwd)

    @property
    def gaps_fwd(self) -> float:
        return self.kernels_fwd * KERNEL_GAP

    @property
    def gaps_bwd(self) -> float:
        return self.kernels_bwd * KERNEL_GAP

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.elem_fwd + self.gaps_fwd

    @property
    def bwd(self) -> float:
        return self.gemm_bwd + self.attn_bwd + self.elem_bwd + self.gaps_bwd


@dataclass(frozen=True)
class EndsCost:
    """Embedding (first stage) and output layer + loss (last stage), one micro-batch: (gemm, elementwise)."""

    emb_fwd: float
    emb_bwd: float
    emb_tp: float
    out_gemm_fwd: float
    out_gemm_bwd: float
    out_elem: float                # cross entropy, forward and backward
    out_tp: float
    batch: float = 0.0             # get_batch on the first or last stage (host-to-device copy, TP broadcast, CP slice)

    @property
    def out_fwd(self) -> float:
        return self.out_gemm_fwd + self.out_elem / 2

    @property
    def out_bwd(self) -> float:
        return self.out_gemm_bwd + self.out_elem / 2


def pipeline_seconds(rank_seconds: tuple[float, ...] | list[float], m: int, vpp: int = 1) -> tuple[float, float]:
    """(steady state, fill and drain) of one step of a pipeline whose ranks take ``rank_seconds`` for one
    micro-batch's forward and backward (all their chunks): ``m x max_i W_i`` and ``(sum_i W_i - max_i W_i) / vpp``.

    With one chunk per rank this is Alpa's pipeline latency (Zheng et al., OSDI 2022, section 5.2:
    T = sum_i t_i + (B - 1) max_j t_j): the slowest rank paces the steady state, and the first forward
    and the last backward cross every other rank once. It is the 1F1B schedule's step when the slowest
    rank is the last (and an upper bound otherwise: the first ranks' warm-up forwards hide part of it).
    With ``vpp`` chunks per rank each fill and drain hop is one chunk, 1/vpp of its rank's work: equal ranks
    give Narayanan et al. 2021's bubble, (PP - 1) / VPP of a stage's time (section 2.2.1)."""
    slowest = max(rank_seconds)
    return m * slowest, (sum(rank_seconds) - slowest) / vpp


def rank_list(ms: list[float]) -> str:
    """Per-rank times in ms, runs of equal ranks folded (``4.10 x 14``)."""
    out, i = [], 0
    while i < len(ms):
        j = i
        while j + 1 < len(ms) and abs(ms[j + 1] - ms[i]) <= 1e-12:
            j += 1
        out.append(f"{ms[i] * 1e3:.2f}" + (f" x {j - i + 1}" if j > i else ""))
        i = j + 1
    return ", ".join(out)


def linear_seconds(M: int, N: int, K: int, gpu, grad_bytes: int = 4) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds of a linear layer: tokens M, output width N,
    input width K. The weight gradient accumulates into the main_grad buffer (Megatron's gradient
    accumulation fusion): ``grad_bytes`` per element read and written."""
    return (gemm_seconds(M, N, K, gpu), gemm_seconds(M, K, N, gpu), gemm_seconds(N, K, M, gpu, c_bytes=2 * grad_bytes))


def ring_attention_steps(b: int, heads: int, seq: int, cp: int, qk_dim: int, v_dim: int,
                         gpu) -> list[tuple[float, float, float]]:
    """(forward s, backward s, forward FLOPs) of each step of the attention on one rank. CP = 1: one
    causal kernel over the sequence. CP > 1 (Megatron's load-balanced ring: each rank holds chunks i and
    2 CP - 1 - i of 2 CP): step 0 is the causal attention of the rank's two chunks; each of the CP - 1
    other steps attends two chunks of queries to one chunk of keys, or one to two (the ring paces at the
    slower)."""
    if cp == 1:
        return [attention_seconds(b, heads, seq, seq, True, qk_dim, v_dim, gpu)]
    ch = seq // (2 * cp)
    steps = [attention_seconds(b, heads, 2 * ch, 2 * ch, True, qk_dim, v_dim, gpu)]
    a = attention_seconds(b, heads, 2 * ch, ch, False, qk_dim, v_dim, gpu)
    z = attention_seconds(b, heads, ch, 2 * ch, False, qk_dim, v_dim, gpu)
    steps += [max(a, z)] * (cp - 1)
    return steps


# dense FP8 / dense BF16 tensor-core peak: 2 on H100 / H200 (1,979 / 989 TFLOP/s), B200 / GB200 (4.5 / 2.25
# PFLOP/s) and MI300X (2,615 / 1,307 TFLOP/s), the vendors' datasheets
FP8_PEAK_RATIO = 2.0


class TimeModel:
    """Step times for candidates of one model on one cluster (memoised by the fields that matter)."""

    def fp8_on(self, c: Candidate) -> bool:
        """Whether the candidate's layers run their GEMMs in FP8 / FP4 (searched with ``--fp8``, or set
        in the model's config)."""
        if c.fp8 is not None:
            return c.fp8 != "off"
        return self._fp8_config

    def __init__(self, shape: ModelShape, cluster: Cluster, global_batch_size: int, tp_overlap: bool = True):
        # tp_overlap: the backward TP collectives run asynchronously behind the GEMM that follows them, as
        # megatron-core's linears issue them (tensor_parallel/layers.py,
        # LinearWithGradAccumulationAndAsyncCommunication.backward: async_op=True, waited after the
        # weight-gradient GEMM; Transformer Engine's linears likewise). False: a framework whose collectives
        # run on the compute stream after the GEMM that produced their input, as the autograd functions of
        # megatron-core's tensor_parallel/mappings.py do (_CopyToModelParallelRegion.backward all-reduces
        # synchronously): every backward collective is exposed (docs/planner.md section 2.7).
        self.tp_overlap = tp_overlap
        self.shape = shape
        self.cluster = cluster
        self.gpu = cluster.gpu
        self.gbs = global_batch_size
        self.peak = cluster.gpu.bf16_flops
        self.domain = min(cluster.tp_domain, cluster.gpus)
        self._layer: dict[tuple, LayerCost] = {}
        self._ends: dict[tuple, EndsCost] = {}
        self._cache: dict[Candidate, StepTime] = {}
        self._params: dict[tuple, int] = {}
        self._dp: dict[tuple, float] = {}
        self._moe_on: dict[tuple, int] = {}
        self._ranks: dict[tuple, tuple[tuple[tuple[float, ...], ...], int, float]] = {}
        self._split_moe: dict[tuple, tuple] = {}
        self._opt: dict[tuple, float] = {}
        self._work_sum: dict[tuple, float] = {}
        self._bound: dict[tuple, float] = {}
        self._floor: dict[tuple, float] = {}
        self._ranks_params: dict[tuple, tuple[tuple[int, int], ...]] = {}
        self._layer_work: dict[tuple, tuple[tuple[float, int], ...]] = {}
        self._fp8_config = shape.layout.fp8_spec.enabled
        s = shape
        self.gdn_cost: dict[tuple, LayerCost] = {}
        self.flops_per_token = (6.0 * (s.matmul_params() + s.vocab * s.hidden)
                                + 6.0 * (s.num_layers - s.gdn_layers) * s.heads * (s.qk_dim + s.v_dim) * s.seq_length)
        if s.gdn_layers:
            # a GDN layer's delta-rule kernel: its forward and backward FLOPs per token (planner/gdn.py), linear in s
            from .gdn import delta_rule_flops_per_token
            g = gdn_shape(s.layout)
            f, bw = delta_rule_flops_per_token(g.key_dim, g.value_dim)
            self.flops_per_token += s.gdn_layers * g.value_heads * (f + bw)
        self._kinds: dict[tuple, tuple] = {}
        if s.kinds:
            self.flops_per_token = self._mixed_flops_per_token()

    # ---- primitives (kept for callers that time one collective) -------------------------------------
    def collective(self, kind: str, nbytes: float, n: int, per_domain: int) -> float:
        return collective_seconds(kind, nbytes, n, per_domain, self.gpu)

    def p2p(self, nbytes: float, same_domain: bool) -> float:
        return p2p_seconds(nbytes, same_domain, self.gpu)

    # ---- where groups sit (Megatron's default rank order tp-cp-ep-dp-pp) --------------------------
    def tp_per_domain(self, tp: int) -> int:
        return min(tp, self.domain)

    def cp_per_domain(self, tp: int, cp: int) -> int:
        return max(1, min(cp, self.domain // tp)) if tp < self.domain else 1

    def dpcp_per_domain(self, tp: int, n: int) -> int:
        return max(1, min(n, self.domain // tp)) if tp < self.domain else 1

    # ---- per-layer and per-end costs ---------------------------------------------------------------
    def layer_cost(self, tp: int, cp: int, b: int, sp: bool, fp8: bool = False, mlp: bool = True) -> LayerCost:
        """One layer; ``mlp=False``: its attention half only (an MoE layer adds its MoE block)."""
        key = (tp, cp, b, sp, fp8) if mlp else (tp, cp, b, sp, fp8, False)
        hit = self._layer.get(key)
        if hit is not None:
            return hit
        s, gpu = self.shape, self.gpu
        # FP8 / FP4 GEMMs (the layer's linears; not the output layer) at the datasheet's dense FP8 peak;
        # TE's quantization kernels are not timed (docs/planner.md)
        ggpu = replace(gpu, bf16_flops=FP8_PEAK_RATIO * gpu.bf16_flops) if fp8 else gpu
        seq = s.seq_length // cp
        M = b * seq
        tok = M // tp if sp else M          # tokens of the sequence-parallel region on this rank
        h, d = s.hidden, s.kv_channels
        a_t, g_t, f_t = s.heads // tp, s.kv_heads_per_rank(tp), (s.ffn // tp if mlp else 0)
        fc1_n = (2 if s.gated else 1) * f_t
        # the token mixer's GEMMs before the core attention, from the recipe of the layers' kind
        mixer = mixer_recipe(uniform_kind(s.layout))
        shapes = mixer.qkv_gemms(s.layout, tp, M, tok)
        gb = s.grad_bytes
        qkv = [linear_seconds(*x, ggpu, gb) for x in shapes]
        fq = sum(2.0 * x[0] * x[1] * x[2] for x in shapes)
        proj = linear_seconds(M, h, a_t * s.v_dim, ggpu, gb)
        fc1 = linear_seconds(M, fc1_n, h, ggpu, gb) if mlp else (0.0, 0.0, 0.0)
        fc2 = linear_seconds(M, h, f_t, ggpu, gb) if mlp else (0.0, 0.0, 0.0)
        gflops = fq + 2.0 * M * (h * a_t * s.v_dim + fc1_n * h + h * f_t)
        qkv_f, qkv_d, qkv_w = (sum(x[i] for x in qkv) for i in range(3))
        gemm_fwd = qkv_f + proj[0] + fc1[0] + fc2[0]
        gemm_bwd = qkv_d + qkv_w + proj[1] + proj[2] + fc1[1] + fc1[2] + fc2[1] + fc2[2]
        eff = gflops / (gemm_fwd * self.peak)
        # attention, one kernel per ring step
        steps = ring_attention_steps(b, a_t, s.seq_length, cp, s.qk_dim, s.v_dim, gpu)
        attn_fwd = sum(x[0] for x in steps)
        attn_bwd = sum(x[1] for x in steps)
        attn_flops = sum(x[2] for x in steps)
        attn_eff = attn_flops / (attn_fwd * self.peak)
        # element-wise kernels
        scale = s.act_bytes / 2
        ef, ef_fwd = (ELEM_F_BYTES_GATED, ELEM_F_FWD_GATED) if s.gated else (ELEM_F_BYTES, ELEM_F_FWD)
        rope_el = mixer.rope_elements(s.layout, tp, M)
        elem = (ELEM_H_BYTES * tok * h + ef * M * f_t + ROPE_BYTES * rope_el) * scale
        elem_fwd = (ELEM_H_FWD * tok * h + ef_fwd * M * f_t + ROPE_FWD * rope_el) * scale
        act_fwd = memory_seconds(ef_fwd * M * f_t * scale, gpu)
        # context-parallel ring: merges of partial outputs, gradient accumulation, its kernels
        cp_merge_f = cp_merge_b = 0.0
        k_fwd, k_bwd = KERNELS_FWD, KERNELS_BWD
        if not mlp:
            k_fwd, k_bwd = k_fwd - MLP_KERNELS_FWD, k_bwd - MLP_KERNELS_BWD
        if cp > 1:
            q_el, kv_el = M * a_t * s.v_dim, 2 * M * g_t * d
            cp_merge_f = memory_seconds(CP_MERGE_BYTES * q_el * (cp - 1), gpu)
            cp_merge_b = memory_seconds(CP_GRAD_BYTES * (M * a_t * s.qk_dim + kv_el) * (cp - 1), gpu)
            k_fwd += CP_KERNELS_FWD * (cp - 1)
            k_bwd += CP_KERNELS_BWD * (cp - 1)
        elem_fwd_s = memory_seconds(elem_fwd, gpu) + cp_merge_f
        elem_bwd_s = memory_seconds(elem - elem_fwd, gpu) + cp_merge_b
        # tensor-parallel collectives on the [s/cp, b, h] activation
        tp_fwd = tp_bwd = 0.0
        if tp > 1:
            S = M * h * s.act_bytes
            k = self.tp_per_domain(tp)
            ag = self.collective("ag", S, tp, k)
            rs = self.collective("rs", S, tp, k)
            ar = self.collective("ar", S, tp, k)
            col_dgrad, col_wgrad = qkv_d + fc1[1], qkv_w + fc1[2]
            nc = 2 if mlp else 1       # column/row pairs: attention and (dense) MLP
            if sp:
                # fwd: all-gather before linear_qkv and linear_fc1, reduce-scatter after linear_proj and
                # linear_fc2; bwd: all-gather of the row-parallel layers' output gradients (exposed),
                # re-gather of the column-parallel inputs (overlapped with their dgrad GEMM) and
                # reduce-scatter of their input gradients (overlapped with their wgrad GEMM).
                tp_fwd = nc * ag + nc * rs
                if self.tp_overlap:
                    tp_bwd = nc * ag + max(0.0, nc * ag - col_dgrad) + max(0.0, nc * rs - col_wgrad)
                else:
                    tp_bwd = 2 * nc * ag + nc * rs
            else:
                # fwd: all-reduce after linear_proj and linear_fc2; bwd: all-reduce of the column-parallel
                # input gradients, overlapped with their wgrad GEMM.
                tp_fwd = nc * ar
                tp_bwd = max(0.0, nc * ar - col_wgrad) if self.tp_overlap else nc * ar
        else:
            col_dgrad = col_wgrad = 0.0
        # context parallelism: ring exchange of K and V blocks (and dK, dV in the backward), each step's
        # transfer overlapped with the attention of the step before it
        cp_fwd = cp_bwd = 0.0
        if cp > 1:
            kv = 2 * b * seq * g_t * d * s.act_bytes
            same = self.cp_per_domain(tp, cp) >= cp
            step_f = self.p2p(kv, same)
            step_b = self.p2p(2 * kv, same)
            cp_fwd = sum(max(0.0, step_f - x[0]) for x in steps[:-1])
            cp_bwd = sum(max(0.0, step_b - x[1]) for x in steps[:-1])
        lc = LayerCost(
            gemm_fwd=gemm_fwd, gemm_bwd=gemm_bwd, gemm_eff=eff, col_dgrad=col_dgrad, col_wgrad=col_wgrad,
            mlp_fwd=fc1[0] + fc2[0] + act_fwd, attn_fwd=attn_fwd, attn_bwd=attn_bwd, attn_eff=attn_eff,
            elem_fwd=elem_fwd_s, elem_bwd=elem_bwd_s, cp_merge_fwd=cp_merge_f, kernels_fwd=k_fwd,
            kernels_bwd=k_bwd, tp_fwd=tp_fwd, tp_bwd=tp_bwd, cp_fwd=cp_fwd, cp_bwd=cp_bwd,
            flops_fwd=gflops + attn_flops,
        )
        self._layer[key] = lc
        return lc

    def moe_layer(self, tp: int, cp: int, b: int, sp: bool, ep: int, etp: int) -> LayerCost:
        """One MoE layer: the attention half of :meth:`layer_cost` plus the MoE block (planner/moe.py)."""
        key = ("moe", tp, cp, b, sp, ep, etp)
        hit = self._layer.get(key)
        if hit is not None:
            return hit
        s = self.shape
        a = self.layer_cost(tp, cp, b, sp, mlp=False)
        m: MoeLayerCost = moe_layer_cost(s.moe, hidden=s.hidden, gated=s.gated, tp=tp, cp=cp, ep=ep, etp=etp, b=b,
                                         seq=s.seq_length, act_bytes=s.act_bytes, grad_bytes=s.grad_bytes,
                                         gpu=self.gpu, domain=self.domain)
        gflops = a.gemm_eff * a.gemm_fwd * self.peak + m.flops_fwd
        gemm_fwd = a.gemm_fwd + m.gemm_fwd
        lc = LayerCost(
            gemm_fwd=gemm_fwd, gemm_bwd=a.gemm_bwd + m.gemm_bwd, gemm_eff=gflops / (gemm_fwd * self.peak),
            col_dgrad=a.col_dgrad, col_wgrad=a.col_wgrad, mlp_fwd=0.0,          # 'mlp' recompute: dense layers only
            attn_fwd=a.attn_fwd, attn_bwd=a.attn_bwd, attn_eff=a.attn_eff, elem_fwd=a.elem_fwd + m.elem_fwd,
            elem_bwd=a.elem_bwd + m.elem_bwd, cp_merge_fwd=a.cp_merge_fwd, kernels_fwd=a.kernels_fwd + m.kernels_fwd,
            kernels_bwd=a.kernels_bwd + m.kernels_bwd, tp_fwd=a.tp_fwd + m.tp_fwd, tp_bwd=a.tp_bwd + m.tp_bwd,
            cp_fwd=a.cp_fwd, cp_bwd=a.cp_bwd, flops_fwd=a.flops_fwd + m.flops_fwd,
            moe_fwd=m.gemm_fwd + m.elem_fwd + m.tp_fwd, ep_fwd=m.dispatch_fwd, ep_bwd=m.dispatch_bwd,
            moe_detail=(f"{m.rows:,} token copies per rank, routed experts at {m.expert_eff:.0%} of peak "
                        f"({'grouped GEMM' if s.moe.grouped_gemm else 'one GEMM per expert'}); {m.detail}"),
        )
        self._layer[key] = lc
        return lc

    def gdn_layer(self, tp: int, cp: int, b: int, sp: bool, fp8: bool = False) -> LayerCost:
        """One dense layer whose token mixer is a gated delta net (planner/gdn.py): :meth:`layer_cost` with
        linear_qkv / linear_proj, the core attention, rope and the K/V ring replaced by in_proj / out_proj, the
        delta-rule kernel, its conv1d and norms, and (CP) its two all-to-alls. The TP collectives are the
        attention layer's (in_proj column-, out_proj row-parallel: the same pair). Only the difference to the
        attention layer is used for a rank (an MoE layer's mixer is the same)."""
        key = (tp, cp, b, sp, fp8)
        hit = self.gdn_cost.get(key)
        if hit is not None:
            return hit
        s, gpu = self.shape, self.gpu
        lc = self.layer_cost(tp, cp, b, sp, fp8)
        ggpu = replace(gpu, bf16_flops=FP8_PEAK_RATIO * gpu.bf16_flops) if fp8 else gpu
        M = b * (s.seq_length // cp)
        tok = M // tp if sp else M
        gb, h, a_t = s.grad_bytes, s.hidden, s.heads // tp
        # the attention mixer's parts of lc (as layer_cost computes them)
        mixer = mixer_recipe(uniform_kind(s.layout))
        shapes = mixer.qkv_gemms(s.layout, tp, M, tok)
        qkv = [linear_seconds(*x, ggpu, gb) for x in shapes]
        proj = linear_seconds(M, h, a_t * s.v_dim, ggpu, gb)
        a_flops = sum(2.0 * x[0] * x[1] * x[2] for x in shapes) + 2.0 * M * h * a_t * s.v_dim
        a_f = sum(x[0] for x in qkv) + proj[0]
        a_b = sum(x[1] + x[2] for x in qkv) + proj[1] + proj[2]
        scale = s.act_bytes / 2
        rope_el = mixer.rope_elements(s.layout, tp, M)
        rope_f = memory_seconds(ROPE_FWD * rope_el * scale, gpu)
        rope_b = memory_seconds((ROPE_BYTES - ROPE_FWD) * rope_el * scale, gpu)
        cp_merge_b = 0.0
        if cp > 1:
            g_t, d = s.kv_heads_per_rank(tp), s.kv_channels
            cp_merge_b = memory_seconds(CP_GRAD_BYTES * (M * a_t * s.qk_dim + 2 * M * g_t * d) * (cp - 1), gpu)
        # the GDN mixer
        g = gdn_shape(s.layout)
        inp = linear_seconds(M, g.in_proj_width(tp), h, ggpu, gb)
        out = linear_seconds(M, h, g.value_width(tp), ggpu, gb)
        g_flops = 2.0 * M * h * (g.in_proj_width(tp) + g.value_width(tp))
        core = gdn_core(g, b=b, seq=s.seq_length, tp=tp, cp=cp, act_bytes=s.act_bytes, gpu=gpu)
        gemm_fwd = lc.gemm_fwd - a_f + inp[0] + out[0]
        gflops = lc.gemm_eff * lc.gemm_fwd * self.peak - a_flops + g_flops
        # CP (core 0.18+): all-to-all of in_proj's output before the conv and of the norm's output before
        # out_proj (common.py tensor_a2a_cp2hp / hp2cp), and both again in the backward; nothing overlaps them
        a2a = 0.0
        if cp > 1:
            k = self.cp_per_domain(tp, cp)
            a2a = sum(all_to_all_seconds(M * w * s.act_bytes, cp, k, gpu)
                      for w in (g.in_proj_width(tp), g.value_width(tp)))
        ring = CP_KERNELS_FWD * (cp - 1), CP_KERNELS_BWD * (cp - 1)
        lg = replace(
            lc, gemm_fwd=gemm_fwd, gemm_bwd=lc.gemm_bwd - a_b + inp[1] + inp[2] + out[1] + out[2],
            gemm_eff=gflops / (gemm_fwd * self.peak),
            col_dgrad=lc.col_dgrad - sum(x[1] for x in qkv) + inp[1] if tp > 1 else 0.0,
            col_wgrad=lc.col_wgrad - sum(x[2] for x in qkv) + inp[2] if tp > 1 else 0.0,
            attn_fwd=core.kernel_fwd, attn_bwd=core.kernel_bwd, attn_eff=core.kernel_eff,
            elem_fwd=lc.elem_fwd - lc.cp_merge_fwd - rope_f + core.elem_fwd,
            elem_bwd=lc.elem_bwd - cp_merge_b - rope_b + core.elem_bwd, cp_merge_fwd=0.0,
            kernels_fwd=lc.kernels_fwd - ATTN_KERNELS_FWD - ring[0] + GDN_KERNELS_FWD,
            kernels_bwd=lc.kernels_bwd - ATTN_KERNELS_BWD - ring[1] + GDN_KERNELS_BWD,
            cp_fwd=a2a, cp_bwd=a2a, flops_fwd=gflops + core.kernel_flops_fwd, gdn=True, gdn_norm_fwd=core.norm_fwd)
        self.gdn_cost[key] = lg
        return lg

    def gdn_layers_on(self, c: Candidate, stage: int) -> int:
        """GDN layers held by one rank of ``stage``."""
        s = self.shape
        return self._layers_on(c, stage, s.gdn_layers_in, "gdn") if s.gdn_pattern else 0

    def _layers_on(self, c: Candidate, stage: int, layers_in, tag: str) -> int:
        """Layers of one kind (``layers_in(first, count)`` counts them in the global order) on one rank of
        ``stage``: its chunks' slices of the global pattern."""
        key = (tag, c.pp, c.vpp, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout, c.segments, stage)
        n = self._moe_on.get(key)
        if n is not None:
            return n
        if c.chunks:                                   # each virtual stage's slice of the global layer order
            starts = [0]
            for k in c.chunks:
                starts.append(starts[-1] + k)
            n = sum(layers_in(starts[i], c.chunks[i]) for i in range(stage, len(c.chunks), c.pp))
        elif c.vpp > 1 and c.first is None and c.last is None:
            ch = self.shape.num_layers // (c.pp * c.vpp)
            n = sum(layers_in((j * c.pp + stage) * ch, ch) for j in range(c.vpp))
        else:
            n = layers_in(sum(c.stage_layers[:stage]), c.stage_layers[stage])
        self._moe_on[key] = n
        return n

    def moe_layers_on(self, c: Candidate, stage: int) -> int:
        """MoE layers held by one rank of ``stage`` (its chunks' slices of the global pattern)."""
        ms = self.shape.moe
        return self._layers_on(c, stage, ms.layers_in, "moe") if ms is not None else 0

    # ---- layers of several kinds (hybrid Mamba models, heterogeneous layer configs: planner/hybrid.py) -----
    def kinds_on(self, c: Candidate, stage: int) -> tuple[int, ...]:
        """Layers of each kind of shape.kind_set on one rank of ``stage``; () when the layers are alike."""
        s = self.shape
        if not s.kinds:
            return ()
        key = ("kinds", c.pp, c.vpp, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout, c.segments, stage)
        hit = self._moe_on.get(key)
        if hit is None:
            # each of its chunks' slices of the global order (as _layers_on), the counts added kind by kind
            if c.chunks:
                starts = [0]
                for k in c.chunks:
                    starts.append(starts[-1] + k)
                slices = [(starts[i], c.chunks[i]) for i in range(stage, len(c.chunks), c.pp)]
            elif c.vpp > 1 and c.first is None and c.last is None:
                ch = s.num_layers // (c.pp * c.vpp)
                slices = [((j * c.pp + stage) * ch, ch) for j in range(c.vpp)]
            else:
                slices = [(sum(c.stage_layers[:stage]), c.stage_layers[stage])]
            counts = [s.kinds_in(a, n) for a, n in slices]
            hit = self._moe_on[key] = tuple(sum(x) for x in zip(*counts))
        return hit

    def kind_costs(self, c: Candidate, fp8: bool) -> tuple[tuple[LayerCost, float], ...]:
        """(cost, recompute seconds) of one layer of each kind of shape.kind_set for the candidate."""
        key = (c.tp, c.cp, c.mbs, c.sp, fp8, c.ep, c.etp, c.recompute)
        hit = self._kinds.get(key)
        if hit is None:
            costs = [self.kind_cost(k, c.tp, c.cp, c.mbs, c.sp, fp8, c.ep, c.etp) for k in self.shape.kind_set]
            hit = self._kinds[key] = tuple((x, self._recompute_layer(x, c.recompute)[0]) for x in costs)
        return hit

    def kind_cost(self, kind: Any, tp: int, cp: int, b: int, sp: bool, fp8: bool = False, ep: int = 1,
                  etp: int = 1) -> LayerCost:
        """One layer of ``kind``: a norm and residual add per half it has (mixer, MLP), plus its mixer's part
        (attention: :meth:`layer_cost`'s attention half less its two norms; Mamba: :meth:`mamba_part`; gated delta
        net: the attention part changed as :meth:`gdn_layer` changes it; a linear replacement; none) and its MLP's
        part (dense of the block's width: :meth:`mlp_part`; MoE: :meth:`moe_layer` less its attention half; a
        linear replacement; none)."""
        from ..partition import MIXER_GDN, MIXER_LINEAR, MIXER_MAMBA, MIXER_NONE, MLP_LINEAR, MLP_MOE, MLP_NONE
        key = ("kind", kind, tp, cp, b, sp, fp8) + ((ep, etp) if kind.mlp == MLP_MOE else ())
        hit = self._layer.get(key)
        if hit is not None:
            return hit
        s = self.shape
        a = self.layer_cost(tp, cp, b, sp, fp8, mlp=False)
        norm = self.norm_part(tp, cp, b, sp)
        parts: list[tuple[float, LayerCost]] = [(0, a)]
        parts.append(((kind.mixer != MIXER_NONE) + (kind.mlp != MLP_NONE), norm))
        if kind.mixer == MIXER_MAMBA:
            parts.append((1, self.mamba_part(tp, cp, b, sp, fp8)))
        elif kind.mixer == MIXER_LINEAR:
            parts.append((1, self.linear_part(tp, cp, b, sp, fp8)))
        elif kind.mixer != MIXER_NONE:
            parts += [(1, a), (-2, norm)]
            if kind.mixer == MIXER_GDN:
                parts += [(1, self.gdn_layer(tp, cp, b, sp, fp8)), (-1, self.layer_cost(tp, cp, b, sp, fp8))]
        if kind.mlp == MLP_MOE:
            # (moe_layer's attention half is timed without FP8: take out that one)
            parts += [(1, self.moe_layer(tp, cp, b, sp, ep, etp)), (-1, self.layer_cost(tp, cp, b, sp, mlp=False))]
        elif kind.mlp == MLP_LINEAR:
            parts.append((1, self.linear_part(tp, cp, b, sp, fp8)))
        elif kind.mlp != MLP_NONE:
            ffn = int(kind.mlp.split(":", 1)[1]) if ":" in kind.mlp else s.ffn
            parts.append((1, self.mlp_part(ffn, tp, cp, b, sp, fp8)))
        lc = self._layer[key] = hyb.combine(parts, self.peak)
        return lc

    def _part(self, **kw: Any) -> LayerCost:
        """A LayerCost of the given fields, the others 0."""
        base = dict(gemm_fwd=0.0, gemm_bwd=0.0, gemm_eff=0.0, col_dgrad=0.0, col_wgrad=0.0, mlp_fwd=0.0, attn_fwd=0.0,
                    attn_bwd=0.0, attn_eff=0.0, elem_fwd=0.0, elem_bwd=0.0, cp_merge_fwd=0.0, kernels_fwd=0,
                    kernels_bwd=0, tp_fwd=0.0, tp_bwd=0.0, cp_fwd=0.0, cp_bwd=0.0, flops_fwd=0.0)
        base.update(kw)
        return LayerCost(**base)

    def norm_part(self, tp: int, cp: int, b: int, sp: bool) -> LayerCost:
        """One norm and one residual add of a layer: half of layer_cost's ELEM_H bytes per token x hidden element."""
        s = self.shape
        M = b * (s.seq_length // cp)
        tok = M // tp if sp else M
        x = tok * s.hidden * s.act_bytes / 2
        return self._part(elem_fwd=memory_seconds(ELEM_H_FWD / 2 * x, self.gpu),
                          elem_bwd=memory_seconds((ELEM_H_BYTES - ELEM_H_FWD) / 2 * x, self.gpu),
                          kernels_fwd=hyb.NORM_KERNELS_FWD, kernels_bwd=hyb.NORM_KERNELS_BWD)

    def pair_tp(self, tp: int, M: int, col_dgrad: float, col_wgrad: float, sp: bool) -> tuple[float, float]:
        """Exposed TP collectives (forward, backward) of one column / row-parallel pair on [M, h] (as layer_cost's,
        with the pair's own column-parallel GEMMs to hide the backward ones behind)."""
        if tp == 1:
            return 0.0, 0.0
        S = M * self.shape.hidden * self.shape.act_bytes
        k = self.tp_per_domain(tp)
        if sp:
            ag, rs = self.collective("ag", S, tp, k), self.collective("rs", S, tp, k)
            bwd = ag + max(0.0, ag - col_dgrad) + max(0.0, rs - col_wgrad) if self.tp_overlap else 2 * ag + rs
            return ag + rs, bwd
        ar = self.collective("ar", S, tp, k)
        return ar, (max(0.0, ar - col_wgrad) if self.tp_overlap else ar)

    def _gemm_gpu(self, fp8: bool):
        return replace(self.gpu, bf16_flops=FP8_PEAK_RATIO * self.gpu.bf16_flops) if fp8 else self.gpu

    def mlp_part(self, ffn: int, tp: int, cp: int, b: int, sp: bool, fp8: bool = False) -> LayerCost:
        """A dense MLP of width ``ffn`` (a heterogeneous block's own, or the model's): fc1, the activation, fc2 and
        their TP pair, as layer_cost times them."""
        s = self.shape
        ggpu, gb, h = self._gemm_gpu(fp8), s.grad_bytes, s.hidden
        M = b * (s.seq_length // cp)
        f_t = ffn // tp
        fc1_n = (2 if s.gated else 1) * f_t
        fc1 = linear_seconds(M, fc1_n, h, ggpu, gb)
        fc2 = linear_seconds(M, h, f_t, ggpu, gb)
        flops = 2.0 * M * (fc1_n * h + h * f_t)
        ef, ef_fwd = (ELEM_F_BYTES_GATED, ELEM_F_FWD_GATED) if s.gated else (ELEM_F_BYTES, ELEM_F_FWD)
        scale = s.act_bytes / 2
        act_f = memory_seconds(ef_fwd * M * f_t * scale, self.gpu)
        tp_f, tp_b = self.pair_tp(tp, M, fc1[1], fc1[2], sp)
        g = fc1[0] + fc2[0]
        return self._part(gemm_fwd=g, gemm_bwd=fc1[1] + fc1[2] + fc2[1] + fc2[2], gemm_eff=flops / (g * self.peak),
                          col_dgrad=fc1[1] if tp > 1 else 0.0, col_wgrad=fc1[2] if tp > 1 else 0.0,
                          mlp_fwd=g + act_f, elem_fwd=act_f,
                          elem_bwd=memory_seconds((ef - ef_fwd) * M * f_t * scale, self.gpu),
                          kernels_fwd=MLP_KERNELS_FWD, kernels_bwd=MLP_KERNELS_BWD, tp_fwd=tp_f, tp_bwd=tp_b,
                          flops_fwd=flops)

    def linear_part(self, tp: int, cp: int, b: int, sp: bool, fp8: bool = False) -> LayerCost:
        """A heterogeneous block's linear replacement (replace_with_linear): one column-parallel [h, h] GEMM whose
        output is all-gathered (forward), its input gradient all-reduced behind its weight gradient (backward)."""
        s = self.shape
        M = b * (s.seq_length // cp)
        x = linear_seconds(M, s.hidden // tp, s.hidden, self._gemm_gpu(fp8), s.grad_bytes)
        flops = 2.0 * M * s.hidden * (s.hidden // tp)
        tp_f = tp_b = 0.0
        if tp > 1:
            S = M * s.hidden * s.act_bytes
            k = self.tp_per_domain(tp)
            tp_f = self.collective("ag", S, tp, k)
            ar = self.collective("ar", S, tp, k)
            tp_b = max(0.0, ar - x[2]) if self.tp_overlap else ar
        return self._part(gemm_fwd=x[0], gemm_bwd=x[1] + x[2], gemm_eff=flops / (x[0] * self.peak),
                          col_dgrad=x[1] if tp > 1 else 0.0, col_wgrad=x[2] if tp > 1 else 0.0, kernels_fwd=1,
                          kernels_bwd=2, tp_fwd=tp_f, tp_bwd=tp_b, flops_fwd=flops)

    def mamba_part(self, tp: int, cp: int, b: int, sp: bool, fp8: bool = False) -> LayerCost:
        """The Mamba mixer (planner/hybrid.py): in_proj and out_proj (one TP pair), the conv1d, the chunked SSD scan
        and the gated norm; under CP the two all-to-alls of heads (MambaContextParallel: before the conv, after the
        scan), forward and again backward, exposed."""
        s = self.shape
        m = hyb.mamba_shape(s.layout)
        ggpu, gb, h = self._gemm_gpu(fp8), s.grad_bytes, s.hidden
        M = b * (s.seq_length // cp)
        w, di = m.in_proj_width(tp), m.d_inner // tp
        inp = linear_seconds(M, w, h, ggpu, gb)
        out = linear_seconds(M, h, di, ggpu, gb)
        flops = 2.0 * M * h * (w + di)
        core = hyb.mamba_core(m, b=b, seq=s.seq_length, tp=tp, cp=cp, act_bytes=s.act_bytes, gpu=self.gpu)
        a2a = 0.0
        if cp > 1:
            k = self.cp_per_domain(tp, cp)
            a2a = sum(all_to_all_seconds(M * x * s.act_bytes, cp, k, self.gpu) for x in (w, di))
        tp_f, tp_b = self.pair_tp(tp, M, inp[1], inp[2], sp)
        g = inp[0] + out[0]
        return self._part(gemm_fwd=g, gemm_bwd=inp[1] + inp[2] + out[1] + out[2], gemm_eff=flops / (g * self.peak),
                          col_dgrad=inp[1] if tp > 1 else 0.0, col_wgrad=inp[2] if tp > 1 else 0.0,
                          attn_fwd=core.kernel_fwd, attn_bwd=core.kernel_bwd, attn_eff=core.kernel_eff,
                          elem_fwd=core.elem_fwd, elem_bwd=core.elem_bwd, kernels_fwd=2 + hyb.KERNELS_FWD,
                          kernels_bwd=4 + hyb.KERNELS_BWD, tp_fwd=tp_f, tp_bwd=tp_b, cp_fwd=a2a, cp_bwd=a2a,
                          flops_fwd=flops + core.kernel_flops_fwd, ssm=True)

    def _mixed_texts(self, c: Candidate, crit: int, fp8: bool, texts: tuple, m: int, gemm: float,
                     where: str) -> tuple:
        """explain's sentences of the per-layer terms for a model with layers of several kinds: each kind on the
        critical stage, how many, and its own numbers."""
        s = self.shape
        rows = [(hyb.kind_name(kind), k, x, r) for kind, k, (x, r) in
                zip(s.kind_set, self.kinds_on(c, crit), self.kind_costs(c, fp8)) if k]

        def each(f) -> str:
            return " + ".join(f"{k} {name} x {f(x, r)}" for name, k, x, r in rows)

        def core(x: LayerCost) -> str:
            if not x.attn_fwd:
                return "0"
            what = "SSD scan" if x.ssm else "delta-rule kernel" if x.gdn else "attention"
            return f"{(x.attn_fwd + x.attn_bwd) * 1e3:.3f} ms {what} at {x.attn_eff:.0%} of peak"

        def cp(x: LayerCost) -> str:
            if not x.cp_fwd + x.cp_bwd:
                return "0"
            what = "all-to-alls of heads" if x.ssm or x.gdn else "exposed K/V ring exchange"
            return f"{(x.cp_fwd + x.cp_bwd) * 1e3:.3f} ms {what}"

        rc_any = any(r for *_, r in rows)
        return (
            (f"{m} micro-batches x {gemm * 1e3:.2f} ms on {where}; per layer, forward + backward: "
             + each(lambda x, r: f"{(x.gemm_fwd + x.gemm_bwd) * 1e3:.3f} ms at {x.gemm_eff:.0%} of peak (forward)")),
            f"{m} x ({each(lambda x, r: core(x))})" + (f", {c.cp} ring steps per attention layer" if c.cp > 1 else ""),
            texts[2],
            f"{m} x ({each(lambda x, r: str(x.kernels_fwd + x.kernels_bwd))}) kernels x {KERNEL_GAP * 1e6:.0f} us",
            texts[4],
            (f"{m} x ({each(lambda x, r: f'{r * 1e3:.3f} ms')}): {self._recompute_layer(rows[0][2], c.recompute)[1]}"
             if rc_any else "no recomputation"),
            (f"{m} x ({each(lambda x, r: f'{(x.tp_fwd + x.tp_bwd) * 1e3:.3f} ms')} + embedding/output) exposed TP "
             f"collectives, TP{c.tp}" + (" with sequence parallelism" if c.sp else " without sequence parallelism")
             if c.tp > 1 else texts[6]),
            f"{m} x ({each(lambda x, r: cp(x))})" if c.cp > 1 else texts[7],
        ) + texts[8:]

    def _mixed_flops_per_token(self) -> float:
        """Model FLOPs per token of a model with layers of several kinds: 6 x every kind's matmul weights and the
        output layer's, plus per attention layer 6 heads (qk + v) s (the dense model's term), per Mamba layer its SSD
        scan (forward and backward, planner/hybrid.py), per GDN layer its delta-rule kernel (planner/gdn.py)."""
        from ..partition import MIXER_GDN, MIXER_LINEAR, MIXER_MAMBA, MIXER_NONE
        s = self.shape
        out = 6.0 * (s.matmul_params() + s.vocab * s.hidden)
        for kind, n in zip(s.kind_set, s.kinds_in(0, s.num_layers)):
            if kind.mixer == MIXER_MAMBA:
                m = hyb.mamba_shape(s.layout)
                out += n * sum(hyb.ssd_flops_per_token(m.heads, m.head_dim, m.groups, m.state, m.chunk))
            elif kind.mixer == MIXER_GDN:
                from .gdn import delta_rule_flops_per_token
                g = gdn_shape(s.layout)
                out += n * g.value_heads * sum(delta_rule_flops_per_token(g.key_dim, g.value_dim))
            elif kind.mixer not in (MIXER_NONE, MIXER_LINEAR):
                out += 6.0 * n * s.heads * (s.qk_dim + s.v_dim) * s.seq_length
        return out

    def ends_cost(self, tp: int, cp: int, b: int, sp: bool) -> EndsCost:
        key = (tp, cp, b, sp)
        hit = self._ends.get(key)
        if hit is not None:
            return hit
        s, gpu = self.shape, self.gpu
        M = b * s.seq_length // cp
        h = s.hidden
        v_t = s.padded_vocab(tp) // tp
        scale = s.act_bytes / 2
        emb_fwd = memory_seconds(4 * M * h * scale, gpu)           # gather rows, write the output
        # scatter-add of the output gradient into a dense [V/t, h] weight gradient, then into main_grad
        emb_bwd = memory_seconds(12 * M * h * scale + self.emb_grad_bytes(tp), gpu)
        out_f, out_d, out_w = linear_seconds(M, v_t, h, gpu, s.grad_bytes)
        ce = memory_seconds((CE_BYTES_FUSED if s.fused_cross_entropy else CE_BYTES) * M * v_t, gpu)
        emb_tp = out_tp = 0.0
        if tp > 1:
            S = M * h * s.act_bytes
            k = self.tp_per_domain(tp)
            # embedding: reduce-scatter (SP) or all-reduce of the vocab-parallel lookup
            emb_tp = self.collective("rs" if sp else "ar", S, tp, k)
            # output layer: all-gather of its input (SP), reduce-scatter / all-reduce of the input gradient
            # (overlapped with the wgrad GEMM), and cross entropy's three all-reduces of [s, b] fp32
            hidden_by = out_w if self.tp_overlap else 0.0
            out_tp = (self.collective("ag", S, tp, k) if sp else 0.0) + max(
                0.0, self.collective("rs" if sp else "ar", S, tp, k) - hidden_by) + 3 * self.collective(
                "ar", M * 4, tp, k)
        ec = EndsCost(emb_fwd, emb_bwd, emb_tp, out_f, out_d + out_w, ce, out_tp, self.batch_seconds(tp, cp, b))
        self._ends[key] = ec
        return ec

    def emb_grad_bytes(self, tp: int) -> float:
        """HBM bytes of the dense input-embedding weight gradient of one micro-batch: zero-filled by
        PyTorch's embedding_dense_backward, added into main_grad by Megatron's DDP hook."""
        s = self.shape
        return (2 * s.param_bytes + 2 * s.grad_bytes) * s.padded_vocab(tp) // tp * s.hidden

    def batch_bytes(self, b: int) -> int:
        """Bytes get_batch copies to the GPU per micro-batch: the batch tensors and, when the data loader
        makes it (--create-attention-mask-in-dataloader), the [b, 1, s, s] bool attention mask."""
        s = self.shape
        return b * s.seq_length * BATCH_BYTES_PER_TOKEN + (b * s.seq_length ** 2 if s.mask_in_dataloader else 0)

    def batch_seconds(self, tp: int, cp: int, b: int) -> float:
        """get_batch on a stage that loads data (megatron/training/utils.py get_batch_on_this_tp_rank and
        get_batch_on_this_cp_rank): TP rank 0 copies the whole micro-batch from pinned host memory
        (.cuda(non_blocking=True) on the compute stream), broadcasts it to the other TP ranks, and each
        context-parallel rank keeps its 2 of 2 CP chunks (index_select: read and write 1/CP of it)."""
        nbytes = self.batch_bytes(b)
        t = host_copy_seconds(nbytes, self.gpu)
        if tp > 1:
            t += self.collective("bc", nbytes, tp, self.tp_per_domain(tp))
        if cp > 1:
            t += memory_seconds(2 * nbytes / cp, self.gpu)
        return t

    def stage_params(self, c: Candidate, stage: int) -> int:
        """Parameters one rank of ``stage`` holds (before DDP padding)."""
        first, last = stage == 0, stage == c.pp - 1
        n_moe = self.moe_layers_on(c, stage)
        n_gdn = self.gdn_layers_on(c, stage)
        kc = self.kinds_on(c, stage)
        key = (c.tp, c.pp > 1, c.stage_layers[stage], first, last, n_moe, n_gdn, kc)
        n = self._params.get(key)
        if n is not None:
            return n
        s = self.shape
        if kc:
            # layers of several kinds: each kind's parameters outside the routed experts (the estimator's recipes)
            n = sum(k * s.kind_params_per_rank(kind, c.tp) for k, kind in zip(kc, s.kind_set))
        else:
            n = (c.stage_layers[stage] - n_moe) * s.layer_params_per_rank(c.tp)
            if n_gdn:
                # a GDN mixer instead of attention (in a dense or an MoE layer alike)
                n += n_gdn * (s.gdn_layer_params_per_rank(c.tp) - s.layer_params_per_rank(c.tp))
            if n_moe:
                n += n_moe * s.moe_layer_params_per_rank(c.tp)
        v_rows = s.padded_vocab(c.tp) // c.tp
        if first:
            n += v_rows * s.hidden + (s.max_positions * s.hidden if s.learned_positions else 0)
        if last:
            n += s.hidden * (2 if s.normalization == "LayerNorm" else 1)
            if s.untied or c.pp > 1:
                n += v_rows * s.hidden
        self._params[key] = n
        return n

    def stage_expert_params(self, c: Candidate, stage: int) -> int:
        """Routed-expert parameters on one rank of ``stage`` (reduced and sharded over expert DP)."""
        n_moe = self.moe_layers_on(c, stage)
        if not n_moe:
            return 0
        key = ("experts", n_moe, c.ep, c.etp)
        n = self._params.get(key)
        if n is None:
            s = self.shape
            n = self._params[key] = n_moe * expert_params_per_rank(s.moe, s.hidden, s.gated, c.ep, c.etp)
        return n

    def mtp_params(self, c: Candidate) -> tuple[int, int]:
        """(dense, routed-expert) parameters of the MTP depths on one rank of the last stage: per depth
        the transformer layer, eh_proj ([2h -> h] / TP) and three norms, plus the last stage's own word
        embedding when PP > 1 (GPTModel builds it for the MTP process)."""
        s = self.shape
        # parameters: one MTP layer with --mtp-use-repeated-layer (estimator/mtp.py layers_built)
        d = s.layout.mtp_num_layers if not s.layout.mtp_use_repeated_layer else min(1, s.layout.mtp_num_layers)
        if not d:
            return 0, 0
        runs = self.hybrid_mtp_runs()
        if runs:
            # a hybrid model's depth: its '/' pattern's layers, each of its kind (the estimator's recipes)
            from ..partition import MLP_MOE
            layer = sum(n * s.kind_params_per_rank(kind, c.tp) for kind, n in runs)
            n_moe = sum(n for kind, n in runs if kind.mlp == MLP_MOE)
        else:
            moe_kind = s.moe is not None and s.moe.pattern[-1]
            layer = s.moe_layer_params_per_rank(c.tp) if moe_kind else s.layer_params_per_rank(c.tp)
            n_moe = int(bool(moe_kind))
        dense = d * (layer + 2 * s.hidden * s.hidden // c.tp + 3 * s.hidden)
        if c.pp > 1:
            dense += s.padded_vocab(c.tp) // c.tp * s.hidden
        experts = d * n_moe * expert_params_per_rank(s.moe, s.hidden, s.gated, c.ep, c.etp) if n_moe else 0
        return dense, experts

    def hybrid_mtp_runs(self) -> tuple:
        """(kind, count) of one MTP depth of a hybrid model, its '/' pattern's layers (estimator/params.py
        mtp_stack_runs: MultiTokenPredictionLayer builds a HybridStack of one layer per symbol); () otherwise."""
        s = self.shape
        if not (s.kinds and s.layout.hybrid_mtp_pattern and s.layout.mtp_num_layers):
            return ()
        from ..estimator.params import mtp_stack_runs
        return mtp_stack_runs(s.layout)

    # ---- the step ---------------------------------------------------------------------------------
    def step_time(self, c: Candidate) -> StepTime:
        """The step time of ``c`` (numbers only; :meth:`explain` adds how each term is computed)."""
        hit = self._cache.get(c)
        if hit is not None:
            return hit
        st = self._step_time(c, False)
        self._cache[c] = st
        return st

    def step_time_bound(self, c: Candidate) -> float:
        """A lower bound on ``step_time(c).seconds`` whose work part reads the pipeline split only through PP
        and VPP, so that a search can leave the step times it never reaches uncomputed (planner/search.py).

        The work terms and the bubble are ``m x W_max + (S - W_max) / v`` over the ranks' per-micro-batch
        work W_i (:meth:`rank_work`; S their sum); as m >= 1 >= 1 / v it grows with W_max, which is at least
        S / p and at least the work of the ceil(L / p) cheapest layers (some rank holds that many), so it is at
        least that with W_max the larger of the two. S does not depend on the split: every layer sits on one
        rank, the embedding on the first, the output layer, loss and MTP depths on the last, get_batch runs
        on both; it is one rank holding all layers, plus the second get_batch. The pipeline transfers are
        exact with one chunk per rank and at least their latency with several. On top, the optimizer step
        and the part of the DP communication no overlap hides (:meth:`step_tail_floor`, memoised by the split
        and the DP layout: they read the first stage's parameters). The last factor keeps rounding (the sums
        taken in another order) from lifting it above the step time."""
        return (self._split_free_bound(c) + self.step_tail_floor(c)) * (1 - 1e-9)

    def step_time_work_bound(self, c: Candidate) -> float:
        """:meth:`step_time_bound` without the DP and optimizer part: a lower bound too, memoised without the split
        (the search's first, cheap look at a candidate)."""
        return self._split_free_bound(c) * (1 - 1e-9)

    def _split_free_bound(self, c: Candidate) -> float:
        """step_time_bound's work, bubble and pipeline-transfer part (the same for every split), memoised."""
        bkey = (c.tp, c.cp, c.mbs, c.sp, c.fp8, c.recompute, c.ep, c.etp, c.pp, c.vpp, c.dp)   # (m: GBS, MBS, DP)
        hit = self._bound.get(bkey)
        if hit is not None:
            return hit
        fp8 = self.fp8_on(c)
        key = (c.tp, c.cp, c.mbs, c.sp, fp8, c.recompute, c.ep, c.etp, c.pp > 1)
        total = self._work_sum.get(key)
        s = self.shape
        n = s.num_layers
        if total is None:
            costs = self._bound_costs(c, fp8)
            every = (n, True, True, s.moe.layers_in(0, n) if s.moe else 0, s.gdn_layers_in(0, n) if s.gdn_pattern else 0,
                     s.kinds_in(0, n) if s.kinds else ())
            total = self._rank_rows(c, (every,), *costs, fp8)[0][0]
            if c.pp > 1:
                total += costs[1].batch
            self._work_sum[key] = total
        p, v, m = c.pp, c.vpp, c.m
        w = total / p
        if n % p and not s.gdn_pattern and not s.kinds:
            # the ranks share the layers out, so one holds at least ceil(L / p) of them: at least the work of the
            # cheapest ceil(L / p) layers of the model, well above S / p where p does not divide L (where it does,
            # at most S / p). (GDN layers mix into either kind: left at S / p.)
            w = max(w, self._cheapest_layers(c, fp8, key, -(-n // p)))
        t = m * w + (total - w) / v
        if p > 1:
            nbytes = c.mbs * (s.seq_length // c.cp) * s.hidden * s.act_bytes // (c.tp if c.sp else 1)
            t1 = self.p2p(nbytes, c.tp * c.cp * c.dp * c.pp <= self.domain)
            t += 2 * (p - 1) * t1 + (2 * m * v * P2P_LATENCY if v > 1 else 2 * m * t1)
        self._bound[bkey] = t
        return t

    def _bound_costs(self, c: Candidate, fp8: bool) -> tuple[LayerCost, EndsCost, LayerCost | None, float, float]:
        """What _rank_rows reads for the bounds: the dense layer's, the ends' and the MoE layer's costs and the two
        layers' recompute seconds."""
        lc = self.layer_cost(c.tp, c.cp, c.mbs, c.sp, fp8)
        lm = self.moe_layer(c.tp, c.cp, c.mbs, c.sp, c.ep, c.etp) if self.shape.moe else None
        return (lc, self.ends_cost(c.tp, c.cp, c.mbs, c.sp), lm, self._recompute_layer(lc, c.recompute)[0],
                self._recompute_layer(lm, c.recompute)[0] if lm is not None else 0.0)

    def _cheapest_layers(self, c: Candidate, fp8: bool, key: tuple, k: int) -> float:
        """Per micro-batch, the work of the k cheapest layers of the model (dense or MoE, each as a middle rank
        holding it alone would run it); ``key``: the work memo's (everything a layer's cost reads)."""
        hit = self._layer_work.get(key)
        s = self.shape
        if hit is None:
            n_moe = s.moe.layers_in(0, s.num_layers) if s.moe else 0
            one = [(1, False, False, 0, 0, ())] + ([(1, False, False, 1, 0, ())] if n_moe else [])
            rows = self._rank_rows(c, one, *self._bound_costs(c, fp8), fp8)
            # (the cheaper kind first, with how many layers of it the model has)
            hit = self._layer_work[key] = tuple(sorted(((rows[0][0], s.num_layers - n_moe), (rows[-1][0], n_moe))))
        (lo, n_lo), (hi, _) = hit
        return min(k, n_lo) * lo + max(0, k - n_lo) * hi

    def explain(self, c: Candidate) -> StepTime:
        """The same step time with a sentence per term saying how it is computed."""
        return self._step_time(c, True)

    def _recompute_layer(self, lc: LayerCost, recompute: str) -> tuple[float, str]:
        if recompute == "full":
            return (lc.fwd + lc.tp_fwd + lc.cp_fwd + lc.ep_fwd,
                    "the whole layer's forward again, with its TP/CP" + ("/EP" if lc.moe_fwd else "") + " communication")
        if recompute == "selective":
            mods = self.shape.recompute_modules
            t, what = 0.0, []
            if "core_attn" in mods and not lc.gdn and not lc.ssm:
                # (a GDN mixer has no core_attention module: GatedDeltaNet checkpoints only its output norm)
                t += lc.attn_fwd + lc.cp_fwd + lc.cp_merge_fwd + KERNEL_GAP
                what.append("core attention")
            if "gdn_norm_out" in mods and lc.gdn:
                t += lc.gdn_norm_fwd + KERNEL_GAP
                what.append("GDN output norm")
            if "mlp" in mods and not lc.moe_fwd:
                t += lc.mlp_fwd + 3 * KERNEL_GAP
                what.append("MLP")
            if "moe" in mods and lc.moe_fwd:
                t += lc.moe_fwd + lc.ep_fwd
                what.append("MoE block with its dispatch")
            if "layernorm" in mods:
                t += (lc.elem_fwd - lc.cp_merge_fwd) * 0.4 + 2 * KERNEL_GAP
                what.append("norms")
            return t, "forward of the " + (", ".join(what) or "nothing") + " again"
        return 0.0, ""

    def _stage_work(self, c: Candidate, n: int, first: bool, last: bool, n_moe: int, lc: LayerCost, ec: EndsCost,
                    lm: LayerCost | None = None, n_gdn: int = 0, lg: LayerCost | None = None,
                    kc: tuple[int, ...] = (), kcosts: tuple = ()) -> tuple[float, ...]:
        """Per micro-batch on a rank of ``n`` layers (``n_moe`` of them MoE, ``n_gdn`` with a GDN mixer), the
        first and / or the last stage: (gemm, attention, elementwise, kernel_gaps, input, tp_comm, ep_comm)."""
        n_dense = n - n_moe
        gemm, attn, elem, gaps, tpc = (n_dense * x for x in lc.per_layer)
        epc = 0.0
        if n_moe:
            gemm, attn, elem, gaps, tpc = (x + n_moe * y for x, y in zip((gemm, attn, elem, gaps, tpc), lm.per_layer))
            epc = n_moe * (lm.ep_fwd + lm.ep_bwd)
        if n_gdn:
            # a GDN mixer instead of attention, whatever the layer's MLP: the difference of the two dense layers
            gemm, attn, elem, gaps, tpc = (x + n_gdn * (y - z) for x, y, z in
                                           zip((gemm, attn, elem, gaps, tpc), lg.per_layer, lc.per_layer))
        if kc:
            # layers of several kinds (planner/hybrid.py): each kind's own cost, as often as the rank has it
            gemm = attn = elem = gaps = tpc = epc = 0.0
            for k, (x, _) in zip(kc, kcosts):
                if k:
                    gemm, attn, elem, gaps, tpc = (a + k * y for a, y in zip((gemm, attn, elem, gaps, tpc), x.per_layer))
                    epc += k * (x.ep_fwd + x.ep_bwd)
        # get_batch runs on the first and the last stage (once when they are the same)
        inp = ec.batch if first or last else 0.0
        if first:
            elem += ec.emb_fwd + ec.emb_bwd
            tpc += ec.emb_tp
        if last:
            gemm += ec.out_gemm_fwd + ec.out_gemm_bwd
            elem += ec.out_elem
            gaps += 6 * KERNEL_GAP
            tpc += ec.out_tp
        return gemm, attn, elem, gaps, inp, tpc, epc

    def rank_kinds(self, c: Candidate) -> tuple[tuple[tuple[int, bool, bool, int, int], ...], tuple[int, ...]]:
        """The distinct kinds of pipeline rank of the split, (layers, first, last, MoE layers, GDN layers), and
        each rank's kind."""
        key = (c.pp, c.vpp, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout, c.segments)
        hit = self._split_moe.get(key)
        if hit is None:
            sigs: list[tuple[int, bool, bool, int, int]] = []
            index = []
            for i in range(c.pp):
                sig = (c.stage_layers[i], i == 0, i == c.pp - 1, self.moe_layers_on(c, i) if self.shape.moe else 0,
                       self.gdn_layers_on(c, i), self.kinds_on(c, i))
                if sig not in sigs:
                    sigs.append(sig)
                index.append(sigs.index(sig))
            hit = self._split_moe[key] = (tuple(sigs), tuple(index))
        return hit

    def mtp_cost(self, c: Candidate, lc: LayerCost, ec: EndsCost, lm: LayerCost | None, rc_layer: float,
                 rc_moe: float, fp8: bool = False) -> tuple[float, ...]:
        """Per micro-batch, the ``--mtp-num-layers`` depths on the last stage (Megatron builds them there,
        multi_token_prediction.py): (gemm, attention, elementwise, kernel_gaps, recompute, tp_comm, cp_comm,
        ep_comm). Each depth embeds the shifted tokens again (the last stage's own word embedding, with its
        dense weight gradient), normalises it and the hidden state (enorm, hnorm), concatenates them into
        eh_proj (a column-parallel [2h -> h] linear), runs one transformer layer of the last decoder
        layer's kind, a final norm, the output layer and the cross entropy (MultiTokenPredictionLayer,
        process_mtp_loss; core 0.16.1 and 0.19.2). A hybrid model's depth runs its '/' pattern's layers instead of
        the transformer layer, each at its kind's cost (:meth:`kind_cost`; core 0.17.1 to 0.19.2)."""
        s = self.shape
        d = s.layout.mtp_num_layers
        if not d:
            return (0.0,) * 8
        M = c.mbs * s.seq_length // c.cp
        tok = M // c.tp if c.sp else M
        proj = sum(linear_seconds(M, s.hidden // c.tp, 2 * s.hidden, self.gpu, s.grad_bytes))
        runs = self.hybrid_mtp_runs()
        if runs:
            gemm = attn = elem = gaps = tpc = rc = cpc = epc = 0.0
            for kind, n in runs:
                x = self.kind_cost(kind, c.tp, c.cp, c.mbs, c.sp, fp8, c.ep, c.etp)
                gemm, attn, elem, gaps, tpc = (a + n * y for a, y in zip((gemm, attn, elem, gaps, tpc), x.per_layer))
                rc += n * self._recompute_layer(x, c.recompute)[0]
                cpc += n * (x.cp_fwd + x.cp_bwd)
                epc += n * (x.ep_fwd + x.ep_bwd)
        else:
            moe_kind = lm is not None and s.moe.pattern[-1]
            x = lm if moe_kind else lc
            rc = rc_moe if moe_kind else rc_layer
            gemm, attn, elem, gaps, tpc = x.per_layer
            cpc, epc = x.cp_fwd + x.cp_bwd, x.ep_fwd + x.ep_bwd
        gemm += proj + ec.out_gemm_fwd + ec.out_gemm_bwd
        elem += ec.emb_fwd + ec.emb_bwd + ec.out_elem + memory_seconds(MTP_ELEM_BYTES * tok * s.hidden * s.act_bytes / 2,
                                                                      self.gpu)
        gaps += MTP_KERNELS * KERNEL_GAP
        tpc += ec.emb_tp + ec.out_tp
        return tuple(d * v for v in (gemm, attn, elem, gaps, rc, tpc, cpc, epc))

    def _rank_rows(self, c: Candidate, sigs, lc: LayerCost, ec: EndsCost, lm: LayerCost | None, rc_layer: float,
                   rc_moe: float, fp8: bool) -> list[tuple[float, ...]]:
        """Per micro-batch on a rank of each kind ``(layers, first, last, MoE layers, GDN layers)`` of ``sigs``:
        (total, gemm, attention, elementwise, kernel_gaps, input, recompute, tp_comm, cp_comm, ep_comm)."""
        layer_cp = lc.cp_fwd + lc.cp_bwd
        mtp = self.shape.layout.mtp_num_layers
        lg = self.gdn_layer(c.tp, c.cp, c.mbs, c.sp, fp8) if self.shape.gdn_pattern else None
        rc_gdn = self._recompute_layer(lg, c.recompute)[0] - rc_layer if lg is not None else 0.0
        kcosts = self.kind_costs(c, fp8) if self.shape.kinds else ()
        kinds = []
        for n, first, last, n_moe, n_gdn, kc in sigs:
            gemm, attn, elem, gaps, inp, tpc, epc = self._stage_work(c, n, first, last, n_moe, lc, ec, lm, n_gdn, lg,
                                                                     kc, kcosts)
            rc = (n - n_moe) * rc_layer + n_moe * rc_moe if n_moe else n * rc_layer
            cpc = n * layer_cp        # an MoE layer's attention half has the dense layer's ring
            if n_gdn:
                # a GDN mixer: its recompute and its all-to-alls instead of the attention's (MLP parts unchanged)
                rc += n_gdn * rc_gdn
                cpc += n_gdn * (lg.cp_fwd + lg.cp_bwd - layer_cp)
            if kc:
                # each kind's recompute and CP exchange (a ring, an all-to-all of heads, or none)
                rc = sum(k * r for k, (_, r) in zip(kc, kcosts))
                cpc = sum(k * (x.cp_fwd + x.cp_bwd) for k, (x, _) in zip(kc, kcosts))
            if last and mtp:
                mg, ma, me, mk, mr, mt, mc, mp = self.mtp_cost(c, lc, ec, lm, rc_layer, rc_moe, fp8)
                gemm, attn, elem, gaps, rc, tpc, cpc, epc = (gemm + mg, attn + ma, elem + me, gaps + mk, rc + mr,
                                                             tpc + mt, cpc + mc, epc + mp)
            kinds.append((gemm + attn + elem + gaps + inp + rc + tpc + cpc + epc,
                          gemm, attn, elem, gaps, inp, rc, tpc, cpc, epc))
        return kinds

    def rank_work(self, c: Candidate, lc: LayerCost, ec: EndsCost, lm: LayerCost | None, rc_layer: float,
                  rc_moe: float, fp8: bool) -> tuple[tuple[tuple[float, ...], ...], int, float]:
        """Per micro-batch on every pipeline rank (all its chunks): (total, gemm, attention, elementwise,
        kernel_gaps, input, recompute, tp_comm, cp_comm, ep_comm), from the layers each rank holds (dense
        and MoE), the embedding on the first, the output layer, loss and MTP depths on the last; with the
        slowest rank and the sum of the other ranks' totals."""
        # (the split follows from PP, VPP, first, last, the account flags and the layout)
        key = (c.tp, c.cp, c.mbs, c.sp, fp8, c.recompute, c.ep, c.etp, c.pp, c.vpp, c.first, c.last,
               c.acc_emb, c.acc_loss, c.pp_layout, c.segments)
        hit = self._ranks.get(key)
        if hit is not None:
            return hit
        sigs, index = self.rank_kinds(c)
        kinds = self._rank_rows(c, sigs, lc, ec, lm, rc_layer, rc_moe, fp8)
        rows = [kinds[j] for j in index]
        # the slowest rank (the first of equals) and the others' sum
        crit = 0
        for i in range(1, c.pp):
            if rows[i][0] > rows[crit][0] + 1e-15:
                crit = i
        out = self._ranks[key] = (tuple(rows), crit, sum(r[0] for r in rows) - rows[crit][0])
        return out

    def _step_time(self, c: Candidate, details: bool) -> StepTime:
        s = self.shape
        fp8 = self.fp8_on(c)
        lc = self.layer_cost(c.tp, c.cp, c.mbs, c.sp, fp8)
        ec = self.ends_cost(c.tp, c.cp, c.mbs, c.sp)
        rc_layer, rc_what = self._recompute_layer(lc, c.recompute)
        lm = self.moe_layer(c.tp, c.cp, c.mbs, c.sp, c.ep, c.etp) if s.moe else None
        rc_moe = self._recompute_layer(lm, c.recompute)[0] if lm is not None else 0.0
        layer_cp = lc.cp_fwd + lc.cp_bwd
        p, v, m = c.pp, c.vpp, c.m
        # Per micro-batch, each rank's forward and backward over all its chunks. The slowest rank paces the
        # 1F1B steady state; the fill and the drain cross every other rank once: the step is
        #   m x max_i W_i + (sum_i W_i - max_i W_i) / v
        # (Alpa, Zheng et al. 2022, section 5.2: T = sum_i t_i + (B - 1) max_j t_j for one chunk per rank;
        # with v chunks per rank each fill/drain hop is one chunk, 1/v of its rank's work, Narayanan et al.
        # 2021 section 2.2.1: bubble (p - 1)/v of a stage when the ranks are equal).
        rows, crit, others = self.rank_work(c, lc, ec, lm, rc_layer, rc_moe, fp8)
        mb, gemm, attn, elem, gaps, inp, rc, tpc, cpc, epc = rows[crit]
        bubble = others / v                   # pipeline_seconds(rank totals, m, v)[1], from the memoised sum
        # pipeline point-to-point: activations forward, gradients backward, once per chunk and micro-batch
        p2p = 0.0
        p2p_detail = "no pipeline"
        if p > 1:
            nbytes = c.mbs * (s.seq_length // c.cp) * s.hidden * s.act_bytes // (c.tp if c.sp else 1)
            # Stage i holds ranks [i X, (i+1) X), X = TP x CP x DP (rank order tp-cp-ep-dp-pp): unless the whole
            # pipeline fits one NVLink domain, some stage boundary crosses it, and that transfer paces the pipeline.
            same = c.tp * c.cp * c.dp * c.pp <= self.domain
            t1 = self.p2p(nbytes, same)
            # the fill and the drain: the first forward and the last backward cross the p - 1 boundaries
            # one after the other, with nothing to overlap
            edges = 2 * (p - 1) * t1
            if v > 1:
                chunk = mb / v / 3     # a chunk's forward, about a third of its work
                p2p = 2 * m * v * max(P2P_LATENCY, t1 - chunk) + edges
                if details:
                    p2p_detail = (f"2 x {m} micro-batches x {v} chunks x max({P2P_LATENCY * 1e6:.0f} us, {t1 * 1e3:.3f} ms "
                                  f"transfer - {chunk * 1e3:.3f} ms chunk forward): {format_bytes(nbytes)} on "
                                  f"{'NVLink' if same else 'the network'}, overlapped (--overlap-p2p-communication); "
                                  f"+ 2 x {p - 1} transfers of the fill and drain")
            else:
                p2p = (2 * m + 2 * (p - 1)) * t1
                if details:
                    p2p_detail = (f"(2 x {m} micro-batches + 2 x {p - 1} of the fill and drain) x {t1 * 1e3:.3f} ms: "
                                  f"{format_bytes(nbytes)} on {'NVLink' if same else 'the network'}, blocking in 1F1B")

        dp_comm, dp_detail = self._dp_comm(c, lc, ec, rc_layer, details, lm, rc_moe)

        elems, shard, per = self.optimizer_elems(c)
        optimizer = memory_seconds(elems * per, self.gpu)
        frozen = s.layout.freeze_all_layers
        if frozen:
            # --freeze-all-layers: no gradient to reduce, no parameter for the optimizer (training.py get_model)
            dp_comm, dp_detail, optimizer = 0.0, "--freeze-all-layers: no gradients to reduce", 0.0

        values = (m * gemm, m * attn, m * elem, m * gaps, m * inp, m * rc, m * tpc, m * cpc, p2p, bubble, dp_comm,
                  optimizer)
        if s.moe:
            values = values[:8] + (m * epc,) + values[8:]
        texts = None
        if details:
            n = c.stage_layers[crit]
            where = f"stage {crit} ({n} layers" + (", embedding" if crit == 0 else "") + (
                ", output layer and loss" if crit == p - 1 else "") + ")"
            texts = (
                f"{m} micro-batches x {gemm * 1e3:.2f} ms on {where}; per layer: forward {lc.gemm_fwd * 1e3:.3f} ms "
                f"at {lc.gemm_eff:.0%} of peak, backward (input and weight gradients) {lc.gemm_bwd * 1e3:.3f} ms",
                f"{m} x {n} layers x {(lc.attn_fwd + lc.attn_bwd) * 1e3:.3f} ms at {lc.attn_eff:.0%} of peak"
                + (f", {c.cp} ring steps per layer" if c.cp > 1 else ", one causal kernel per layer"),
                f"{m} x {elem * 1e3:.2f} ms of norms, residual adds, rope, activation, embedding (with its dense weight "
                f"gradient), cross entropy"
                + (f", merges of the ring's partial results {lc.cp_merge_fwd * 1e3:.3f} ms per layer forward"
                   if c.cp > 1 else "") + f" at {self.gpu.hbm_bytes_per_s * HBM_EFFICIENCY / 1e12:.2f} TB/s",
                f"{m} x {n} layers x {lc.kernels_fwd + lc.kernels_bwd} kernels x {KERNEL_GAP * 1e6:.0f} us",
                (f"{m} x {inp * 1e3:.3f} ms: get_batch copies {format_bytes(self.batch_bytes(c.mbs))} per micro-batch"
                 + (" (with the [b, 1, s, s] attention mask)" if s.mask_in_dataloader else "")
                 + f" host to GPU at {self.gpu.host_bytes_per_s * HOST_LINK_EFFICIENCY / 1e9:.0f} GB/s"
                 + (f", broadcasts it over TP{c.tp}" if c.tp > 1 else "")
                 + (f", keeps 1/{c.cp} of it on each CP rank" if c.cp > 1 else "")) if inp else "no data on this stage",
                f"{m} x {n} layers x {rc_layer * 1e3:.3f} ms: {rc_what}" if rc_layer else "no recomputation",
                (f"{m} x ({n} layers x {(lc.tp_fwd + lc.tp_bwd) * 1e3:.3f} ms + embedding/output) exposed TP collectives, "
                 f"TP{c.tp} {'on NVLink' if c.tp <= self.domain else 'across nodes (hierarchical)'}"
                 + (" with sequence parallelism" if c.sp else " without sequence parallelism")
                 + ("" if self.tp_overlap else "; none overlapped (synchronous TP collectives)")) if c.tp > 1 else "TP = 1",
                f"{m} x {n} layers x {layer_cp * 1e3:.3f} ms exposed K/V ring exchange" if c.cp > 1 else "CP = 1",
                p2p_detail,
                (f"fill and drain: the other {p - 1} ranks' work per micro-batch / VPP = {others * 1e3:.2f} ms / {v} "
                 f"(step = m x slowest rank + this; Alpa, Zheng et al. 2022 section 5.2; Narayanan et al. 2021: "
                 f"(PP-1)/VPP of a stage when the ranks are equal); per micro-batch ms on ranks 0..{p - 1}: "
                 + rank_list([r[0] for r in rows])) if p > 1 else "no pipeline",
                dp_detail,
                "--freeze-all-layers: no optimizer step" if frozen else
                f"{elems / 1e6:,.1f}M parameters{' (a 1/' + str(shard) + ' shard)' if shard > 1 else ''} x {per:.0f} B "
                f"read and written at {self.gpu.hbm_bytes_per_s * HBM_EFFICIENCY / 1e12:.2f} TB/s",
            )
            n_gdn = self.gdn_layers_on(c, crit)
            if n_gdn:
                lg = self.gdn_layer(c.tp, c.cp, c.mbs, c.sp, fp8)
                texts = (texts[:1] + (
                    f"{m} x ({n - n_gdn} attention layers x {(lc.attn_fwd + lc.attn_bwd) * 1e3:.3f} ms at "
                    f"{lc.attn_eff:.0%} of peak + {n_gdn} gated delta net layers x "
                    f"{(lg.attn_fwd + lg.attn_bwd) * 1e3:.3f} ms of the chunked delta-rule kernel at "
                    f"{lg.attn_eff:.0%} of peak)",) + texts[2:7] + (
                    (f"{m} x ({n - n_gdn} attention layers x {layer_cp * 1e3:.3f} ms exposed K/V ring exchange + "
                     f"{n_gdn} gated delta net layers x {(lg.cp_fwd + lg.cp_bwd) * 1e3:.3f} ms of all-to-alls of heads)"
                     if c.cp > 1 else texts[7]),) + texts[8:])
            if s.kinds:
                texts = self._mixed_texts(c, crit, fp8, texts, m, gemm, where)
            if s.moe:
                n_moe = self.moe_layers_on(c, crit)
                texts = texts[:8] + (
                    f"{m} x {n_moe} MoE layers x {(lm.ep_fwd + lm.ep_bwd) * 1e3:.3f} ms exposed token dispatch "
                    f"(forward and backward): {lm.moe_detail}",) + texts[8:]
        return StepTime(candidate=c, values=values, details=texts, model_flops_per_token=self.flops_per_token,
                        tokens_per_step=self.gbs * s.seq_length, world=self.cluster.gpus, peak_flops=self.peak,
                        critical_stage=crit, names=TERM_NAMES_MOE if s.moe else TERM_NAMES,
                        stage_seconds=tuple(r[0] for r in rows))

    def optimizer_elems(self, c: Candidate) -> tuple[float, int, int]:
        """The optimizer step's parameters on the largest stage (dense ones over the distributed optimizer's
        shard, routed-expert ones over the expert-DP shard), that shard, and the bytes read and written per
        parameter: the step is memory-bound over them."""
        s = self.shape
        shard = max(1, c.dp * c.cp // s.dist_opt_instances) if c.dist_opt else 1
        e_shard = max(1, c.edp // s.dist_opt_instances) if c.dist_opt and s.moe else 1
        okey = (c.tp, c.ep, c.etp, c.pp, c.vpp, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout, c.segments, shard,
                e_shard)
        elems = self._opt.get(okey)
        if elems is None:
            ranks = self._rank_params(c)
            if s.moe:
                elems = max(dense / shard + experts / e_shard for dense, experts in ranks)
            else:
                elems = max(dense for dense, _ in ranks) / shard
            self._opt[okey] = elems
        return elems, shard, 2 * s.optimizer_state_bytes + OPTIMIZER_BYTES_EXTRA

    def _rank_params(self, c: Candidate) -> tuple[tuple[int, int], ...]:
        """The distinct (dense, routed-expert) parameter counts of the pipeline ranks, the MTP depths on the
        last (one list per split, whatever the DP shards the optimizer divides them by)."""
        key = (c.tp, c.ep, c.etp, c.pp, c.vpp, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout, c.segments)
        hit = self._ranks_params.get(key)
        if hit is None:
            p, moe = c.pp, self.shape.moe is not None
            mtp = self.mtp_params(c)
            _, index = self.rank_kinds(c)
            # (one rank of each kind: the ranks of a kind hold the same layers, so the same parameters)
            ranks = [index.index(j) for j in range(max(index) + 1)]
            hit = self._ranks_params[key] = tuple(
                (self.stage_params(c, i) + (mtp[0] if i == p - 1 else 0),
                 self.stage_expert_params(c, i) + (mtp[1] if i == p - 1 else 0) if moe else 0) for i in ranks)
        return hit

    def step_tail_floor(self, c: Candidate) -> float:
        """A lower bound of the dp_comm and optimizer terms of ``c``'s step time, for step_time_bound: the
        optimizer step exactly, and of each DP collective the part no overlap hides (the last bucket: ``tail``
        of it, one FSDP unit per micro-batch), which reads neither the micro-batch size nor recomputation nor
        SP. At thousands of DP ranks the ring's latency alone is milliseconds, and leaving both out let the
        search time most of a large plan's candidates to find them slower than the layouts it ranks."""
        s = self.shape
        key = (c.tp, c.cp, c.dp, c.pp, c.vpp, c.first, c.last, c.acc_emb, c.acc_loss, c.pp_layout, c.segments,
               c.dist_opt, c.fsdp, c.ep, c.etp, c.m if c.fsdp else 0)
        hit = self._floor.get(key)
        if hit is not None:
            return hit
        if s.layout.freeze_all_layers:
            floor = 0.0           # (no gradients, no optimizer step: _step_time)
        else:
            elems, _, per = self.optimizer_elems(c)
            floor = memory_seconds(elems * per, self.gpu) + self._dp_floor(c)
        self._floor[key] = floor
        return floor

    def _dp_floor(self, c: Candidate) -> float:
        """What _dp_comm charges at least whatever the compute it hides behind: max(x - w, tail x) >= tail x."""
        s = self.shape
        n_dp = c.dp * c.cp
        psi_e = self.stage_expert_params(c, 0) if s.moe else 0
        if n_dp <= 1 and (not psi_e or c.edp <= 1):
            return 0.0
        psi0 = self.stage_params(c, 0)
        k = self.dpcp_per_domain(c.tp, n_dp)
        tail = min(1.0, max(DDP_MIN_BUCKET, 1_000_000 * c.dp) / (psi0 + psi_e))
        if c.fsdp in ("optim_grads_params", "optim_grads"):
            rs = self.collective("rs", psi0 * min(s.grad_bytes, s.param_bytes), n_dp, k)
            ag = self.collective("ag", psi0 * s.param_bytes, n_dp, k)
            unit = 1.0 / max(1, c.stage_layers[0])
            if c.fsdp == "optim_grads_params":
                return c.m * (unit * ag + unit * (ag + rs))
            return c.m * (unit * rs) + tail * ag
        e_rs = e_ag = e_ar = 0.0
        if psi_e and c.edp > 1:
            ke = edp_per_domain(c.edp, c.ep, c.etp, self.domain)
            e_rs = self.collective("rs", psi_e * s.grad_bytes, c.edp, ke)
            e_ag = self.collective("ag", psi_e * s.param_bytes, c.edp, ke)
            e_ar = self.collective("ar", psi_e * s.grad_bytes, c.edp, ke)
        if c.dist_opt:
            rs = self.collective("rs", psi0 * s.grad_bytes, n_dp, k) + e_rs
            ag = self.collective("ag", psi0 * s.param_bytes, n_dp, k) + e_ag
            return tail * rs + tail * ag
        return tail * (self.collective("ar", psi0 * s.grad_bytes, n_dp, k) + e_ar)

    def _fsdp_comm(self, c: Candidate, key: tuple, psi0: float, n_dp: int, k: int, n0: int, w_f: float, w_b: float,
                   tail: float, details: bool) -> tuple[float, str]:
        """Megatron-FSDP reduce-scatters every micro-batch's gradients (the parameter dtype, core 0.19)
        during its backward; optim_grads_params also all-gathers every unit before its forward and
        again before its backward. The first unit (one layer of the stage's n0) cannot hide."""
        s = self.shape
        rs = self.collective("rs", psi0 * min(s.grad_bytes, s.param_bytes), n_dp, k)
        ag = self.collective("ag", psi0 * s.param_bytes, n_dp, k)
        unit = 1.0 / max(1, n0)
        if c.fsdp == "optim_grads_params":
            per_mb = max(ag - w_f, unit * ag) + max(ag + rs - w_b, unit * (ag + rs))
            t = c.m * per_mb
        else:   # optim_grads: whole weights, gathered once after the step
            per_mb = max(rs - w_b, unit * rs)
            t = c.m * per_mb + max(ag - w_f, tail * ag)
        self._dp[key] = t
        if not details:
            return t, ""
        text = (f"Megatron-FSDP {c.fsdp}: per micro-batch a reduce-scatter of the gradients {rs * 1e3:.1f} ms"
                + (f" and two all-gathers of the parameters {ag * 1e3:.1f} ms each" if c.fsdp == "optim_grads_params"
                   else f"; one all-gather of the parameters {ag * 1e3:.1f} ms per step")
                + f", behind {w_f * 1e3:.1f} ms forward / {w_b * 1e3:.1f} ms backward; {c.m} micro-batches, "
                  f"{n_dp} ranks, {k} per NVLink domain")
        return t, text

    def _dp_comm(self, c: Candidate, lc: LayerCost, ec: EndsCost, rc_layer: float, details: bool,
                 lm: LayerCost | None = None, rc_moe: float = 0.0) -> tuple[float, str]:
        """Gradients reduce-scatter (+ parameters all-gather) or all-reduce over DP x CP, for the first
        stage (it runs the last backward of the step), overlapped with the backward of the last
        micro-batch (--overlap-grad-reduce) and the forward of the first (--overlap-param-gather). The
        routed experts' gradients go over the expert-data-parallel group (their own buffers)."""
        s = self.shape
        n_dp = c.dp * c.cp
        psi_e = self.stage_expert_params(c, 0) if lm is not None else 0
        if n_dp <= 1 and (not psi_e or c.edp <= 1):
            return 0.0, "DP x CP = 1: nothing to reduce"
        key = (c.tp, c.cp, c.mbs, c.sp, c.dp, c.pp, c.stage_layers[0], c.dist_opt, c.recompute, c.fsdp, self.fp8_on(c),
               c.ep, c.etp, (c.vpp, c.chunks) if s.gdn_pattern or lm is not None or s.kinds else 0)
        if not details and key in self._dp:
            return self._dp[key], ""
        psi0 = self.stage_params(c, 0)
        k = self.dpcp_per_domain(c.tp, n_dp)
        n0 = c.stage_layers[0]
        n_moe = self.moe_layers_on(c, 0) if lm is not None else 0
        w_b = (n0 - n_moe) * (lc.bwd + lc.tp_bwd + lc.cp_bwd + rc_layer) + ec.emb_bwd
        w_f = (n0 - n_moe) * (lc.fwd + lc.tp_fwd + lc.cp_fwd) + ec.emb_fwd + ec.emb_tp
        if n_moe:
            w_b += n_moe * (lm.bwd + lm.tp_bwd + lm.cp_bwd + lm.ep_bwd + rc_moe)
            w_f += n_moe * (lm.fwd + lm.tp_fwd + lm.cp_fwd + lm.ep_fwd)
        n_gdn = self.gdn_layers_on(c, 0)
        if n_gdn:
            # a GDN mixer instead of attention in those layers (planner/gdn.py)
            lg = self.gdn_layer(c.tp, c.cp, c.mbs, c.sp, self.fp8_on(c))
            rc_gdn = self._recompute_layer(lg, c.recompute)[0]
            w_b += n_gdn * (lg.bwd + lg.cp_bwd + rc_gdn - lc.bwd - lc.cp_bwd - rc_layer)
            w_f += n_gdn * (lg.fwd + lg.cp_fwd - lc.fwd - lc.cp_fwd)
        kc = self.kinds_on(c, 0)
        if kc:
            # layers of several kinds: the first stage's own layers (planner/hybrid.py)
            kcosts = self.kind_costs(c, self.fp8_on(c))
            w_b = ec.emb_bwd + sum(k * (x.bwd + x.tp_bwd + x.cp_bwd + x.ep_bwd + r) for k, (x, r) in zip(kc, kcosts))
            w_f = ec.emb_fwd + ec.emb_tp + sum(k * (x.fwd + x.tp_fwd + x.cp_fwd + x.ep_fwd)
                                               for k, (x, r) in zip(kc, kcosts))
        if c.pp == 1:
            w_b += ec.out_bwd
            w_f += ec.out_fwd
        bucket = max(DDP_MIN_BUCKET, 1_000_000 * c.dp)
        tail = min(1.0, bucket / (psi0 + psi_e))
        gbytes = psi0 * s.grad_bytes
        if c.fsdp in ("optim_grads_params", "optim_grads"):
            return self._fsdp_comm(c, key, psi0, n_dp, k, n0, w_f, w_b, tail, details)
        # expert gradients: their own buffers over expert DP (EDP ranks, ETP x EP apart)
        e_rs = e_ag = e_ar = 0.0
        e_text = ""
        if psi_e and c.edp > 1:
            ke = edp_per_domain(c.edp, c.ep, c.etp, self.domain)
            e_rs = self.collective("rs", psi_e * s.grad_bytes, c.edp, ke)
            e_ag = self.collective("ag", psi_e * s.param_bytes, c.edp, ke)
            e_ar = self.collective("ar", psi_e * s.grad_bytes, c.edp, ke)
            e_text = (f"; expert gradients {format_bytes(psi_e * s.grad_bytes)} over expert DP {c.edp} ({ke} per "
                      f"NVLink domain)")
        if c.dist_opt:
            rs = self.collective("rs", gbytes, n_dp, k) + e_rs
            ag = self.collective("ag", psi0 * s.param_bytes, n_dp, k) + e_ag
            t = max(rs - w_b, tail * rs) + max(ag - w_f, tail * ag)
            self._dp[key] = t
            if not details:
                return t, ""
            text = (f"reduce-scatter of {format_bytes(gbytes)} gradients {rs * 1e3:.1f} ms behind {w_b * 1e3:.1f} ms of "
                    f"the last backward + all-gather of parameters {ag * 1e3:.1f} ms behind {w_f * 1e3:.1f} ms of the "
                    f"first forward; {n_dp} ranks, {k} per NVLink domain; the last bucket ({tail:.0%}) stays exposed"
                    + e_text)
        else:
            ar = self.collective("ar", gbytes, n_dp, k) + e_ar
            t = max(ar - w_b, tail * ar)
            self._dp[key] = t
            if not details:
                return t, ""
            text = (f"all-reduce of {format_bytes(gbytes)} gradients {ar * 1e3:.1f} ms behind {w_b * 1e3:.1f} ms of the "
                    f"last backward; {n_dp} ranks, {k} per NVLink domain; the last bucket ({tail:.0%}) stays exposed"
                    + e_text)
        return t, text
