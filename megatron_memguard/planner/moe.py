"""Mixture of experts in the planner: the expert grid (EP, ETP, expert-DP), the parameters one rank
holds, and the step-time pieces of an MoE layer (docs/planner.md section 3.6).

Pure functions of a small frozen :class:`MoeShape` (built from Megatron's flat argument names), the
candidate's parallel sizes and the GPU's numbers. Sources (moe-fp8.md section 1 of the shared
reference, megatron-core 0.16.1 and 0.19.2):

* the expert grid: ``initialize_model_parallel`` builds a second rank generator
  ``RankGenerator(tp=ETP, ep=EP, dp=EDP, pp=PP, order="tp-ep-dp-pp")`` with
  ``EDP = world / (ETP x EP x PP)`` and raises unless it divides; an EP group is EP ranks ETP apart,
  so it spans ETP x EP consecutive ranks (inside an NVLink domain when ETP x EP divides it);
* tokens: MoE with TP > 1 trains with sequence parallelism (``MoELayer.forward``), so a rank routes
  ``T = b s / (TP CP)`` tokens; under balanced routing its local experts receive ``N = T k ETP``
  token copies (each ETP rank gathers its ETP group's tokens);
* the dispatchers (``moe/token_dispatcher.py``): ``alltoall`` sends the ``T k`` copies over EP
  (dispatch, combine, and both again in the backward) and all-gathers / reduce-scatters them over ETP;
  ``allgather`` all-gathers the ``[T, h]`` hidden states of the whole ETP x EP group and
  reduce-scatters the result back; ``flex`` (DeepEP / HybridEP) sends each token once per destination
  rank rather than once per expert (``fused_dispatch``), the expected number of distinct ranks among
  its k experts under uniform routing. Nothing
  overlaps the dispatch with compute unless ``--overlap-moe-expert-parallel-comm`` (not modelled), so
  the time is exposed;
* the experts: ``TEGroupedMLP`` (``--moe-grouped-gemm``) runs the local experts' GEMMs as one
  grouped kernel whose tiles fill the SMs together; ``SequentialMLP`` runs one GEMM per expert, each
  with its own partly filled last wave and its own kernel launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..gpus import GpuSpec
from .comm import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, P2P_LATENCY, collective_seconds
from .kernels import GEMM_HALF_K, GEMM_TILE, HBM_EFFICIENCY, memory_seconds, wave_efficiency

DISPATCHERS = ("allgather", "alltoall", "flex")
# Bytes per element of the token permutation kernels (moe_utils.permute / unpermute, or TE's fused
# permute): read the hidden state and write it to its new row, bf16 (scaled by act bytes / 2), in
# the forward (permute + unpermute) and again in the backward.
PERMUTE_BYTES = 4
# Router per token x expert element, forward + backward: fp32 logits written and read by the softmax /
# top-k (4 + 4), the routing map and probabilities (1 + 4), their gradient (4 + 4): about 20 B.
ROUTER_ELEM_BYTES = 20
# Kernels an MoE layer adds to the layer's count (router GEMM, softmax/top-k, aux loss, permute,
# unpermute, the dispatcher's collectives and index work), forward and backward; per local expert
# without grouped GEMM (fc1, activation, fc2 forward; 2 GEMMs each for fc1 and fc2 and the activation
# backward).
MOE_KERNELS_FWD = 10
MOE_KERNELS_BWD = 14
SEQUENTIAL_KERNELS_FWD = 3
SEQUENTIAL_KERNELS_BWD = 5


@dataclass(frozen=True)
class MoeShape:
    """The MoE settings the planner needs (Megatron's defaults where a flag is unset)."""

    experts: int
    topk: int
    ffn: int                        # --moe-ffn-hidden-size (ffn_hidden_size when unset)
    pattern: tuple[bool, ...]       # per global layer: MoE (True) or dense
    shared_ffn: int = 0             # --moe-shared-expert-intermediate-size
    shared_gate: bool = False
    dispatcher: str = "allgather"
    grouped_gemm: bool = False
    etp: int | None = None          # --expert-tensor-parallel-size as given (None: TP)
    ep: int | None = None           # --expert-model-parallel-size as given (the planner searches it when None)

    @property
    def moe_layers(self) -> int:
        return sum(self.pattern)

    def layers_in(self, first: int, count: int) -> int:
        """MoE layers among global layers [first, first + count)."""
        return sum(self.pattern[first:first + count])


def moe_shape_from_args(a: Mapping[str, Any], num_layers: int, ffn_hidden_size: int) -> MoeShape | None:
    """The MoE shape of a model written as Megatron arguments (None: a dense model)."""
    from ..numbers import bound_reason, to_int, upper_bound
    from ..readers.moe_freq import moe_layers, parse_moe_layer_freq

    n = a.get("num_experts")
    if not n:
        return None
    freq = parse_moe_layer_freq(a.get("moe_layer_freq", 1), "--moe-layer-freq")
    pattern = tuple(moe_layers(freq, num_layers))
    def count(dest: str, default: int | None, minimum: int = 1) -> int | None:
        # the raw flag value (text beyond 64 bits, a float, a word): checked as resolve() checks it, since
        # the planner searches this setting and its probe layout does not read the value given
        v = a.get(dest)
        if v is None or v == "" or v is False or v == 0:
            return default
        return to_int(v, "--" + dest.replace("_", "-"), minimum=minimum, maximum=upper_bound(dest),
                      why=bound_reason(dest))

    return MoeShape(
        experts=count("num_experts", 0), topk=count("moe_router_topk", 2) or 2,
        ffn=count("moe_ffn_hidden_size", None) or ffn_hidden_size,
        pattern=pattern, shared_ffn=count("moe_shared_expert_intermediate_size", 0) or 0,
        shared_gate=bool(a.get("moe_shared_expert_gate")), dispatcher=str(a.get("moe_token_dispatcher_type") or "allgather"),
        grouped_gemm=bool(a.get("moe_grouped_gemm")),
        etp=count("expert_tensor_parallel_size", None), ep=count("expert_model_parallel_size", None),
    )


# ---- the expert grid ---------------------------------------------------------------------------------
def expert_grid_problem(world: int, pp: int, ep: int, etp: int, experts: int) -> str | None:
    """Megatron's rules for an expert layout, as the message Megatron gives, or None."""
    if experts % ep:
        # validate_args
        return f"--expert-model-parallel-size {ep} must divide --num-experts {experts}"
    if world % (etp * ep * pp):
        # parallel_state.initialize_model_parallel (after validate_args: a dry run of it does not catch this)
        return (f"world size {world} is not divisible by expert tensor parallel {etp} x expert parallel {ep} x "
                f"pipeline parallel {pp}")
    return None


def expert_data_parallel_size(world: int, pp: int, ep: int, etp: int) -> int:
    """EDP = world / (ETP x EP x PP): the group expert gradients are reduced (and sharded) over."""
    return world // (etp * ep * pp)


def ep_per_domain(ep: int, etp: int, domain: int) -> int:
    """Members of one EP group inside one NVLink domain (EP ranks are ETP apart, rank order tp-ep-dp-pp)."""
    if etp >= domain:
        return 1
    return max(1, min(ep, domain // etp))


def edp_per_domain(edp: int, ep: int, etp: int, domain: int) -> int:
    """Members of one expert-DP group inside one NVLink domain (ETP x EP apart)."""
    span = etp * ep
    if span >= domain:
        return 1
    return max(1, min(edp, domain // span))


# ---- parameters --------------------------------------------------------------------------------------
def expert_params_per_rank(ms: MoeShape, hidden: int, gated: bool, ep: int, etp: int) -> int:
    """Routed-expert weights of one MoE layer on one rank: E/EP experts, fc1 [g F/ETP, h] and
    fc2 [h, F/ETP] each (megatron-core splits the expert FFN over ETP itself)."""
    g = 2 if gated else 1
    return (ms.experts // ep) * (g + 1) * ms.ffn * hidden // etp


def moe_dense_params_per_rank(ms: MoeShape, hidden: int, gated: bool, tp: int) -> int:
    """The MoE layer's weights outside the expert grid: the router [E, h] (whole on every rank), the
    shared expert (split over TP like a dense MLP) and its gate [1, h]."""
    g = 2 if gated else 1
    n = ms.experts * hidden
    if ms.shared_ffn:
        n += (g + 1) * ms.shared_ffn * hidden // tp
    if ms.shared_gate:
        n += hidden
    return n


def moe_matmul_params(ms: MoeShape, hidden: int, gated: bool) -> int:
    """Weights one token multiplies in an MoE layer's MLP (the '6N' of model FLOPs): the router, k
    experts and the shared expert."""
    g = 2 if gated else 1
    return ms.experts * hidden + ms.topk * (g + 1) * ms.ffn * hidden + (g + 1) * ms.shared_ffn * hidden


# ---- tokens ------------------------------------------------------------------------------------------
def tokens_per_rank(b: int, seq: int, tp: int, cp: int) -> int:
    """Tokens one rank routes per micro-batch: the sequence-parallel share ``b s / (TP CP)``."""
    return max(1, b * seq // (cp * tp))


def balanced_rows(T: int, topk: int, etp: int) -> int:
    """Token copies this rank's local experts process under balanced routing: ``T k ETP``."""
    return T * topk * etp


# ---- kernels -----------------------------------------------------------------------------------------
def grouped_gemm_seconds(groups: int, M: int, N: int, K: int, gpu: GpuSpec, grouped: bool,
                         c_bytes: float = 2.0) -> float:
    """``groups`` GEMMs of M x N x K (one per local expert). Grouped: one kernel whose output tiles of
    all groups fill the SMs in common waves. Sequential: one kernel per group, each with its own last
    wave (:func:`.kernels.gemm_seconds` each). Either way no faster than its HBM traffic."""
    from .kernels import gemm_seconds

    if groups <= 0 or M <= 0:
        return 0.0
    if not grouped:
        return groups * gemm_seconds(M, N, K, gpu, c_bytes)
    big, small = max(M, N), min(M, N)
    tiles = math.ceil(big / GEMM_TILE[0]) * math.ceil(small / GEMM_TILE[1])
    fill = (big * small) / (tiles * GEMM_TILE[0] * GEMM_TILE[1])
    eff = gpu.gemm_efficiency * wave_efficiency(groups * tiles, gpu.sms) * fill * K / (K + GEMM_HALF_K)
    t = 2.0 * groups * M * N * K / (gpu.bf16_flops * eff)
    mem = groups * (2.0 * (M * K + K * N) + c_bytes * M * N) / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    return max(t, mem)


def distinct_ranks(experts: int, topk: int, ep: int) -> float:
    """Expected distinct EP ranks among a token's k experts when they are k distinct experts drawn
    uniformly (E/EP per rank): EP x (1 - C(E - E/EP, k) / C(E, k)). DeepEP's dispatch sends a token once
    per such rank."""
    if ep <= 1:
        return 1.0
    local = experts // ep
    miss = 1.0
    for i in range(min(topk, experts)):
        miss *= max(0.0, (experts - local - i) / (experts - i))
    return ep * (1.0 - miss)


def all_to_all_seconds(nbytes: float, n: int, per_domain: int, gpu: GpuSpec) -> float:
    """An all-to-all over ``n`` ranks in which each rank sends ``nbytes`` spread evenly over the group
    (1/n stays local): the share for peers in the same NVLink domain goes over NVLink, the rest through
    the rank's NIC, both at once; one point-to-point latency."""
    if n <= 1:
        return 0.0
    k = max(1, min(n, per_domain))
    nvl = nbytes * (k - 1) / n / (gpu.nvlink_bytes_per_s * NVLINK_EFFICIENCY)
    net = nbytes * (n - k) / n / (gpu.network_bytes_per_s * NETWORK_EFFICIENCY)
    return P2P_LATENCY + max(nvl, net)


@dataclass(frozen=True)
class MoeLayerCost:
    """The MLP part of one MoE layer, one micro-batch, one GPU (seconds), replacing the dense MLP's."""

    gemm_fwd: float                 # router, routed experts, shared expert
    gemm_bwd: float
    expert_eff: float               # efficiency of the routed experts' forward GEMMs (fraction of peak)
    elem_fwd: float                 # router softmax / top-k, permute and unpermute, the expert activation
    elem_bwd: float
    kernels_fwd: int
    kernels_bwd: int
    dispatch_fwd: float             # exposed token dispatch + combine (EP all-to-all / all-gather, ETP)
    dispatch_bwd: float
    tp_fwd: float                   # the shared expert's TP collectives (sequence parallel)
    tp_bwd: float
    rows: int                       # token copies the local experts process (balanced)
    flops_fwd: float
    detail: str


def moe_layer_cost(ms: MoeShape, *, hidden: int, gated: bool, tp: int, cp: int, ep: int, etp: int, b: int, seq: int,
                   act_bytes: int, grad_bytes: int, gpu: GpuSpec, domain: int) -> MoeLayerCost:
    """The MoE MLP of one layer under balanced routing (the expected rows per expert)."""
    from .kernels import gemm_seconds

    h, g = hidden, (2 if gated else 1)
    T = tokens_per_rank(b, seq, tp, cp)
    N = balanced_rows(T, ms.topk, etp)
    local = max(1, ms.experts // ep)
    rows = max(1, math.ceil(N / local))            # per local expert
    f_t = ms.ffn // etp
    grouped = ms.grouped_gemm
    wg = 2 * grad_bytes                            # weight gradients accumulate into main_grad
    # router: [T, h] x [h, E] (replicated weight), its input gradient and weight gradient
    r_f, r_d, r_w = gemm_seconds(T, ms.experts, h, gpu), gemm_seconds(T, h, ms.experts, gpu), \
        gemm_seconds(ms.experts, h, T, gpu, c_bytes=wg)
    # routed experts: fc1 [rows, g F/ETP, h], fc2 [rows, h, F/ETP]; backward: dgrad and wgrad of each
    fc1 = (grouped_gemm_seconds(local, rows, g * f_t, h, gpu, grouped),
           grouped_gemm_seconds(local, rows, h, g * f_t, gpu, grouped),
           grouped_gemm_seconds(local, g * f_t, h, rows, gpu, grouped, wg))
    fc2 = (grouped_gemm_seconds(local, rows, h, f_t, gpu, grouped),
           grouped_gemm_seconds(local, rows, f_t, h, gpu, grouped),
           grouped_gemm_seconds(local, h, f_t, rows, gpu, grouped, wg))
    e_flops = 2.0 * local * rows * (g * f_t * h + h * f_t)
    e_fwd = fc1[0] + fc2[0]
    expert_eff = e_flops / (e_fwd * gpu.bf16_flops) if e_fwd else 0.0
    # shared expert: a dense MLP of width F_s split over TP, on all b s / CP tokens
    M = b * seq // cp
    sh_f = sh_b = 0.0
    sh_flops = 0.0
    if ms.shared_ffn:
        fs_t = ms.shared_ffn // tp
        s1 = (gemm_seconds(M, g * fs_t, h, gpu), gemm_seconds(M, h, g * fs_t, gpu), gemm_seconds(g * fs_t, h, M, gpu, wg))
        s2 = (gemm_seconds(M, h, fs_t, gpu), gemm_seconds(M, fs_t, h, gpu), gemm_seconds(h, fs_t, M, gpu, wg))
        sh_f, sh_b = s1[0] + s2[0], s1[1] + s1[2] + s2[1] + s2[2]
        sh_flops = 2.0 * M * (g * fs_t * h + h * fs_t)
    gemm_fwd = r_f + e_fwd + sh_f
    gemm_bwd = r_d + r_w + fc1[1] + fc1[2] + fc2[1] + fc2[2] + sh_b
    # element-wise: router scores, permute + unpermute of the rows, the weighted activation on the rows
    scale = act_bytes / 2
    perm = PERMUTE_BYTES * N * h * scale
    act_f = (6 if gated else 4) * N * f_t * scale
    act_b = (10 if gated else 8) * N * f_t * scale
    router_el = ROUTER_ELEM_BYTES * T * ms.experts
    elem_fwd = memory_seconds(2 * perm + act_f + router_el * 0.4, gpu)
    elem_bwd = memory_seconds(2 * perm + act_b + router_el * 0.6, gpu)
    k_fwd, k_bwd = MOE_KERNELS_FWD, MOE_KERNELS_BWD
    if not grouped:
        k_fwd += SEQUENTIAL_KERNELS_FWD * local
        k_bwd += SEQUENTIAL_KERNELS_BWD * local
    # dispatch and combine, forward; the backward mirrors them
    disp, detail = dispatch_seconds(ms.dispatcher, T=T, N=N, topk=ms.topk, hidden=h, act_bytes=act_bytes, ep=ep,
                                    etp=etp, gpu=gpu, domain=domain, experts=ms.experts)
    # shared expert under sequence parallelism: all-gather its input, reduce-scatter its output
    tp_f = tp_b = 0.0
    if ms.shared_ffn and tp > 1:
        S = M * h * act_bytes
        k = min(tp, domain)
        tp_f = collective_seconds("ag", S, tp, k, gpu) + collective_seconds("rs", S, tp, k, gpu)
        tp_b = tp_f
    return MoeLayerCost(gemm_fwd=gemm_fwd, gemm_bwd=gemm_bwd, expert_eff=expert_eff, elem_fwd=elem_fwd,
                        elem_bwd=elem_bwd, kernels_fwd=k_fwd, kernels_bwd=k_bwd, dispatch_fwd=disp, dispatch_bwd=disp,
                        tp_fwd=tp_f, tp_bwd=tp_b, rows=N, flops_fwd=2.0 * T * ms.experts * h + e_flops + sh_flops,
                        detail=detail)


def dispatch_seconds(dispatcher: str, *, T: int, N: int, topk: int, hidden: int, act_bytes: int, ep: int, etp: int,
                     gpu: GpuSpec, domain: int, experts: int | None = None) -> tuple[float, str]:
    """Forward dispatch + combine of one MoE layer (the backward sends the gradients the same way)."""
    row = hidden * act_bytes
    if dispatcher == "allgather":
        n = etp * ep
        if n <= 1:
            return 0.0, "EP x ETP = 1: no token exchange"
        k = min(n, domain)
        S = T * n * row                       # the gathered [T ETP EP, h] hidden states
        t = collective_seconds("ag", S, n, k, gpu) + collective_seconds("rs", S, n, k, gpu)
        return t, f"all-gather + reduce-scatter of {T * n:,} tokens over ETP x EP = {n} ({k} per NVLink domain)"
    # alltoall: each token copy leaves for its expert's rank and comes back; flex (DeepEP): once per rank
    k = ep_per_domain(ep, etp, domain)
    copies = T * topk if dispatcher != "flex" or experts is None else T * distinct_ranks(experts, topk, ep)
    a2a = all_to_all_seconds(copies * row, ep, k, gpu)
    t = 2 * a2a
    text = f"2 all-to-alls of {copies:,.0f} token copies over EP {ep} ({k} per NVLink domain)"
    if etp > 1:
        ke = min(etp, domain)
        t += collective_seconds("ag", N * row, etp, ke, gpu) + collective_seconds("rs", N * row, etp, ke, gpu)
        text += f", all-gather + reduce-scatter of {N:,} rows over ETP {etp}"
    if dispatcher == "flex":
        text += " (flex: once per destination rank)"
    return t, text
