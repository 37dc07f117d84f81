"""The layouts the planner may choose from, under the constraints the user gave and Megatron's rules.

A :class:`Candidate` is one point of the 4D layout space: tensor (TP), pipeline (PP, with uneven
first/last stages where the layers do not divide, and virtual stages VPP), context (CP) and data
parallelism (DP, what is left of the GPUs), sequence parallelism, the micro-batch size, activation
recomputation (none / selective / full) and the distributed optimizer; for a mixture-of-experts model
also expert parallelism (EP) and expert tensor parallelism (ETP), the expert-data-parallel size being
what is left of the GPUs (``world / (ETP x EP x PP)``).

:func:`enumerate_space` generates the candidates cheaply from the rules that are known before any
estimate (``megatron.md`` section 2.3): ``world % (TP*PP*CP) == 0``; heads divisible by TP and query
groups a multiple or divisor of TP; TP groups inside a node (TP divides the GPUs per node) unless
``allow_tp_across_nodes``; ``seq % (2*CP) == 0``; PP <= layers, an even split or first/last stages
that leave an even split of the middle ones; VPP dividing every stage's layers, with the interleaved
schedule's micro-batch rule (``PP <= group <= m`` and a last group of 0 or >= PP, the group being PP);
``GBS % (MBS*DP) == 0``; CP = 1 with ``--transformer-impl local``; sequence parallelism only where TP divides the tokens of a CP rank (``seq/CP``;
megatron-core's scatter along the sequence asserts it); for MoE: EP divides the experts, ``world % (ETP*EP*PP) == 0``
(``initialize_model_parallel``), ETP divides the expert FFN, sequence parallelism whenever TP > 1
(``MoELayer.forward``), the EP x ETP group inside an NVLink domain unless ``allow_ep_across_nodes``
(ETP in {1, TP} unless given). Every candidate the planner estimates or shows is then resolved by
:func:`megatron_memguard.resolve.resolve`, which checks all of Megatron's rules again; a candidate
it rejects is counted and dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..config import RawConfig
from ..divisors import divisors
from ..errors import ConfigError
from ..gpus import GpuSpec
from ..layout import DTYPE_BYTES, Layout
from ..tokenizers import pad_vocab
from .moe import MoeShape, moe_dense_params_per_rank, moe_matmul_params, moe_shape_from_args

RECOMPUTE_LEVELS = ("none", "selective", "full")
# Default micro-batch sizes tried: every divisor of GBS/DP up to this bound (--mbs overrides).
DEFAULT_MAX_MBS = 16
# Default context-parallel sizes keep at least this many tokens per CP rank (--cp overrides): below
# it the ring exchange of K/V blocks is no longer hidden behind the attention of a block.
MIN_TOKENS_PER_CP_RANK = 1024
# Arguments the planner decides; the same arguments in the model config are ignored (noted).
SEARCHED_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
    "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "micro_batch_size", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_activations", "distribute_saved_activations", "use_distributed_optimizer",
    "overlap_grad_reduce", "overlap_param_gather", "decrease_batch_size_if_needed",
    "microbatch_group_size_per_vp_stage", "expert_model_parallel_size", "expert_tensor_parallel_size",
)


@dataclass(frozen=True)
class Constraints:
    """What the user allows; ``None`` means the planner's default range."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    mbs: tuple[int, ...] | None = None
    max_tp: int | None = None
    allow_tp_across_nodes: bool = False
    recompute: tuple[str, ...] = RECOMPUTE_LEVELS
    dist_opt: tuple[bool, ...] = (True, False)
    sp: tuple[bool, ...] = (True, False)
    uneven: bool = True            # first/last stages where the layers do not divide
    ep: tuple[int, ...] | None = None            # expert-parallel sizes (MoE; None: divisors of the experts)
    etp: tuple[int, ...] | None = None           # expert-tensor-parallel sizes (None: 1 and TP)
    allow_ep_across_nodes: bool = False          # EP x ETP groups larger than an NVLink domain


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: GpuSpec
    nvlink_domain: int             # GPUs that reach each other over NVLink (the node, or an NVL72 rack)
    gpu_memory_bytes: int

    @property
    def tp_domain(self) -> int:
        """Largest TP group that stays on NVLink: the node, or the NVLink domain when larger."""
        return max(self.gpus_per_node, self.nvlink_domain)


@dataclass(frozen=True)
class ModelShape:
    """The model as the planner's time model and memory bound need it (from a resolved probe Layout)."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    kv_channels: int
    vocab: int                     # before padding
    vocab_divisible_by: int
    pad_vocab: bool
    fixed_padded_vocab: int | None
    gated: bool
    untied: bool
    learned_positions: bool
    max_positions: int
    normalization: str
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    seq_length: int
    param_bytes: int
    act_bytes: int
    grad_bytes: int
    optimizer: str
    optimizer_state_bytes: float   # fp32 main params + moments per parameter (before DP sharding)
    dist_opt_instances: int
    recompute_modules: tuple[str, ...]
    transformer_impl: str
    rope: bool = True
    fp32_logits: bool = True       # cross entropy on an fp32 copy of the logits (not --fp16-lm-cross-entropy)
    unfused_attention: bool = False  # the s x s scores are materialised (local spec, or --attention-backend unfused)
    fused_cross_entropy: bool = False  # --cross-entropy-loss-fusion
    mask_in_dataloader: bool = True  # --create-attention-mask-in-dataloader (Megatron's default): a [b, 1, s, s] bool mask per batch
    # multi-latent attention: (q_lora_rank or 0, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim)
    mla: tuple[int, int, int, int, int] | None = None
    moe: MoeShape | None = None    # mixture of experts (planner/moe.py); None: every layer dense

    @property
    def qk_dim(self) -> int:
        """Head dim of queries and keys (MLA: the content and rope parts)."""
        return self.mla[2] + self.mla[3] if self.mla else self.kv_channels

    @property
    def v_dim(self) -> int:
        return self.mla[4] if self.mla else self.kv_channels

    def attention_weights(self) -> tuple[int, int]:
        """(split over TP, whole on every TP rank) weights of one layer's attention projections."""
        h, a = self.hidden, self.heads
        if not self.mla:
            return h * a * self.kv_channels + (a + 2 * self.groups) * self.kv_channels * h, 0
        ql, kvl, qk, pe, v = self.mla
        split = a * (qk + pe) * (ql or h) + a * (qk + v) * kvl + h * a * v       # q (up), kv up, linear_proj
        whole = (ql * h if ql else 0) + (kvl + pe) * h                            # the down projections
        return split, whole

    def padded_vocab(self, tp: int) -> int:
        if self.fixed_padded_vocab:
            return self.fixed_padded_vocab
        return pad_vocab(self.vocab, self.vocab_divisible_by, tp) if self.pad_vocab else self.vocab

    def kv_heads_per_rank(self, tp: int) -> int:
        """Query groups on one TP rank (replicated when TP > groups)."""
        return max(1, self.groups // tp)

    def layer_params_per_rank(self, tp: int) -> int:
        """Parameters of one transformer layer on one TP rank (sharded weights / TP, replicated norms)."""
        h, a, g, d, f = self.hidden, self.heads, self.groups, self.kv_channels, self.ffn
        norm = 2 if self.normalization == "LayerNorm" else 1
        attn, whole = self.attention_weights()
        sharded = attn + (2 if self.gated else 1) * f * h + f * h
        n = sharded // tp + whole + 2 * norm * h
        if self.add_bias_linear:
            n += 2 * h + (2 if self.gated else 1) * f // tp
        if self.mla:
            if self.qk_layernorm:
                n += norm * (self.mla[0] + self.mla[1])                          # the latent norms
            return n
        if self.add_qkv_bias:
            n += (a + 2 * g) * d // tp
        if self.qk_layernorm:
            n += 2 * norm * d
        return n

    def layer_matmul_params(self) -> int:
        """Weights of one dense layer that multiply an activation (the '6N' of the FLOP count)."""
        h, f = self.hidden, self.ffn
        return sum(self.attention_weights()) + (2 if self.gated else 1) * f * h + f * h

    def matmul_params(self) -> int:
        """Weights a token multiplies in all the layers: the dense layers', and in an MoE layer the
        attention, router, top-k experts and shared expert."""
        if not self.moe:
            return self.num_layers * self.layer_matmul_params()
        n_moe = self.moe.moe_layers
        moe = sum(self.attention_weights()) + moe_matmul_params(self.moe, self.hidden, self.gated)
        return (self.num_layers - n_moe) * self.layer_matmul_params() + n_moe * moe

    def moe_layer_params_per_rank(self, tp: int) -> int:
        """Parameters of one MoE layer on one rank outside the expert grid: the attention and norms of
        :meth:`layer_params_per_rank` without its dense MLP, plus the router and shared expert."""
        f = self.ffn
        mlp = ((2 if self.gated else 1) * f * self.hidden + f * self.hidden) // tp
        if self.add_bias_linear:
            mlp += self.hidden + (2 if self.gated else 1) * f // tp
        return self.layer_params_per_rank(tp) - mlp + moe_dense_params_per_rank(self.moe, self.hidden, self.gated, tp)


def model_shape(L: Layout, raw: RawConfig) -> ModelShape:
    """The shape of the model from a probe layout resolved at TP=PP=CP=1."""
    if L.use_precision_aware_optimizer:
        main = 0 if L.params_dtype == "fp32" else (
            2 if (L.store_param_remainders and L.params_dtype == "bf16" and L.main_params_dtype == "fp32")
            else DTYPE_BYTES[L.main_params_dtype])
        opt = main + DTYPE_BYTES[L.exp_avg_dtype] + (DTYPE_BYTES[L.exp_avg_sq_dtype] if L.optimizer == "adam" else 0)
    else:
        main = 0 if L.params_dtype == "fp32" else 4
        opt = main + (8 if L.optimizer == "adam" else 4)
    grad = 2 if (L.use_precision_aware_optimizer and L.main_grads_dtype == "bf16") else L.grad_bytes
    fixed_padded = raw.args.get("padded_vocab_size")
    pad = raw.args.get("pad_vocab_size", True)
    if isinstance(pad, str):
        pad = pad.strip().lower() in ("1", "true", "yes", "on")
    return ModelShape(
        num_layers=L.num_layers, hidden=L.hidden_size, ffn=L.ffn_hidden_size, heads=L.num_attention_heads,
        groups=L.num_query_groups, kv_channels=L.kv_channels, vocab=L.vocab_size or L.padded_vocab_size,
        vocab_divisible_by=L.make_vocab_size_divisible_by, pad_vocab=bool(pad),
        fixed_padded_vocab=int(fixed_padded) if fixed_padded else None, gated=L.gated_linear_unit,
        untied=L.untie_embeddings_and_output_weights, learned_positions=L.position_embedding_type == "learned_absolute",
        max_positions=L.max_position_embeddings, normalization=L.normalization, add_bias_linear=L.add_bias_linear,
        add_qkv_bias=L.add_qkv_bias, qk_layernorm=L.qk_layernorm, seq_length=L.seq_length,
        param_bytes=L.param_bytes, act_bytes=L.act_bytes, grad_bytes=grad, optimizer=L.optimizer,
        optimizer_state_bytes=opt, dist_opt_instances=L.num_distributed_optimizer_instances,
        recompute_modules=L.recompute_modules, transformer_impl=L.transformer_impl,
        rope=L.position_embedding_type in ("rope", "yarn"), fp32_logits=not L.fp16_lm_cross_entropy,
        unfused_attention=L.transformer_impl == "local" or L.attention_backend in ("unfused", "local"),
        fused_cross_entropy=bool(L.cross_entropy_loss_fusion),
        mask_in_dataloader=bool(L.create_attention_mask_in_dataloader),
        mla=((L.q_lora_rank or 0, L.kv_lora_rank, L.qk_head_dim, L.qk_pos_emb_head_dim, L.v_head_dim)
             if L.multi_latent_attention else None),
        moe=moe_shape_from_args(raw.args, L.num_layers, L.ffn_hidden_size),
    )


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    cp: int
    vpp: int                       # 1: no virtual pipeline
    first: int | None              # --decoder-first-pipeline-num-layers (uneven split) or None
    last: int | None               # --decoder-last-pipeline-num-layers
    sp: bool
    mbs: int
    recompute: str                 # none | selective | full (uniform, 1 layer per checkpoint)
    dist_opt: bool
    dp: int
    m: int                         # micro-batches per step and pipeline: GBS / (MBS * DP)
    stage_layers: tuple[int, ...] = field(compare=False, hash=False, default=())
    ep: int = 1                    # expert-parallel size (MoE)
    etp: int = 1                   # expert-tensor-parallel size (MoE)
    moe: bool = False              # an MoE model: the expert sizes are written out

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: world / (ETP x EP x PP) (= DP x CP x TP / (ETP x EP))."""
        return self.dp * self.cp * self.tp // (self.etp * self.ep)

    @property
    def name(self) -> str:
        """The compact spelling ``--explain`` takes: tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=none[,...]."""
        s = f"tp={self.tp},pp={self.pp},vpp={self.vpp},cp={self.cp},mbs={self.mbs},recompute={self.recompute}"
        if self.tp > 1 and not self.sp:
            s += ",sp=off"
        if not self.dist_opt:
            s += ",dist-opt=off"
        if self.first is not None or self.last is not None:
            s += f",first={self.first},last={self.last}"
        if self.moe:
            s += f",ep={self.ep},etp={self.etp}"
        return s

    @property
    def label(self) -> str:
        """Human spelling for tables: TP8 PP4 (VPP5) CP1 SP MBS1 ..."""
        parts = [f"TP{self.tp}", f"PP{self.pp}" + (f"x{self.vpp}v" if self.vpp > 1 else ""), f"CP{self.cp}"]
        if self.first is not None or self.last is not None:
            parts[1] += f"[{self.first}|..|{self.last}]"
        parts.append(f"DP{self.dp}")
        if self.moe:
            parts.append(f"EP{self.ep}" + (f" ETP{self.etp}" if self.etp != self.tp else ""))
        parts.append(f"MBS{self.mbs}")
        if self.tp > 1:
            parts.append("SP" if self.sp else "noSP")
        parts.append({"none": "", "selective": "sel-rc", "full": "full-rc"}[self.recompute])
        parts.append("" if self.dist_opt else "no-distopt")
        return " ".join(p for p in parts if p)

    def overrides(self, global_batch_size: int, seq_length: int) -> dict[str, Any]:
        """Megatron argument values (dest names) that put this candidate into a RawConfig."""
        o: dict[str, Any] = {k: None for k in SEARCHED_ARGS}
        o.update(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp, context_parallel_size=self.cp,
            sequence_parallel=self.sp and self.tp > 1, micro_batch_size=self.mbs, global_batch_size=global_batch_size,
            seq_length=seq_length, use_distributed_optimizer=self.dist_opt, overlap_grad_reduce=True,
            overlap_param_gather=self.dist_opt,
        )
        if self.moe:
            o.update(expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp)
        if self.vpp > 1:
            o["num_virtual_stages_per_pipeline_rank"] = self.vpp
        if self.first is not None:
            o["decoder_first_pipeline_num_layers"] = self.first
        if self.last is not None:
            o["decoder_last_pipeline_num_layers"] = self.last
        if self.recompute == "selective":
            o["recompute_granularity"] = "selective"
        elif self.recompute == "full":
            o.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return o


def layer_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None, tuple[int, ...]]]:
    """Ways to split the layers over ``pp`` stages: the even split, or (where the layers do not divide)
    first/last stages around evenly split middle stages whose largest stage has ceil(L/PP) layers.
    Returns (first, last, layers per stage)."""
    if pp == 1:
        return [(None, None, (num_layers,))]
    if num_layers % pp == 0:
        return [(None, None, (num_layers // pp,) * pp)]
    if pp > num_layers:
        return []
    best = -(-num_layers // pp)
    out = []
    seen = set()
    for mid in sorted({num_layers // pp, best}):
        rest = num_layers - (pp - 2) * mid
        if pp == 2:
            rest = num_layers
        if rest < 2:
            continue
        lo, hi = rest // 2, rest - rest // 2
        for first, last in ((lo, hi), (hi, lo)):
            if first < 1 or last < 1 or max(first, last, mid if pp > 2 else 0) > best:
                continue
            stages = (first,) + (mid,) * (pp - 2) + (last,)
            if stages not in seen:
                seen.add(stages)
                out.append((first, last, stages))
    return out


def _allowed(values: Iterable[int], allowed: tuple[int, ...] | None) -> list[int]:
    return [v for v in values if allowed is None or v in allowed]


def tp_values(shape: ModelShape, cluster: Cluster, cons: Constraints) -> list[int]:
    """TP sizes: divisors of the GPU count that the heads and query groups allow, inside a node
    (dividing the GPUs per node, or the NVLink domain) unless TP may span nodes."""
    out = []
    dom = min(cluster.tp_domain, cluster.gpus)
    for t in divisors(cluster.gpus):
        if shape.heads % t or (shape.groups % t and t % shape.groups):
            continue
        if cons.max_tp is not None and t > cons.max_tp:
            continue
        if t <= dom and dom % t:
            continue                   # some TP groups would straddle two nodes
        if t > dom and (not cons.allow_tp_across_nodes or t % dom):
            continue                   # across nodes only when allowed, and then whole nodes
        out.append(t)
    return _allowed(out, cons.tp)


def expert_sizes(shape: ModelShape, cluster: Cluster, cons: Constraints, tp: int, pp: int) -> list[tuple[int, int]]:
    """(EP, ETP) pairs for one TP and PP: ((1, 1),) for a dense model. EP divides the experts and
    ``world % (ETP*EP*PP) == 0`` (initialize_model_parallel); ETP divides the expert FFN (TE splits
    its columns); by default ETP is 1 or TP and the EP x ETP group stays in one NVLink domain (the
    all-to-all crosses no NIC), EP never above the experts."""
    ms = shape.moe
    if ms is None:
        return [(1, 1)]
    world = cluster.gpus
    dom = min(cluster.tp_domain, world)
    etps = sorted({1, tp}) if cons.etp is None else list(cons.etp)
    out = []
    for etp in etps:
        if etp < 1 or ms.ffn % etp:
            continue
        for ep in divisors(ms.experts):
            if cons.ep is not None and ep not in cons.ep:
                continue
            if world % (etp * ep * pp):
                continue
            span = etp * ep
            if cons.ep is None and not cons.allow_ep_across_nodes and (span > dom or dom % span):
                continue
            out.append((ep, etp))
    return out


def enumerate_space(shape: ModelShape, cluster: Cluster, global_batch_size: int, cons: Constraints,
                    rule: str = "time") -> list[Candidate]:
    """Every candidate allowed by the constraints and the rules known before an estimate.

    ``rule='fujii2024'`` restricts to the space Fujii et al. searched: TP*CP within a node, even
    pipeline splits, plain 1F1B (no VPP), no recomputation, SP whenever TP > 1, the distributed
    optimizer (the constraints can still narrow it further)."""
    fujii = rule == "fujii2024"
    L, s, world = shape.num_layers, shape.seq_length, cluster.gpus
    out: list[Candidate] = []
    recompute = [r for r in cons.recompute if r in RECOMPUTE_LEVELS]
    if fujii:
        recompute = [r for r in recompute if r == "none"]
    dist_opts = [d for d in cons.dist_opt if not fujii or d]
    moe = shape.moe is not None
    for tp in tp_values(shape, cluster, cons):
        # megatron-core's own attention (--transformer-impl local) asserts CP = 1; only TE's does ring attention
        for cp in (divisors(world // tp) if shape.transformer_impl != "local" else [1]):
            if cp > 1 and s % (2 * cp):
                continue
            if cons.cp is None and s // cp < MIN_TOKENS_PER_CP_RANK and cp > 1:
                continue
            if cons.cp is not None and cp not in cons.cp:
                continue
            if fujii and tp * cp > cluster.gpus_per_node:
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > L or (cons.pp is not None and pp not in cons.pp):
                    continue
                dp = world // (tp * cp * pp)
                experts = expert_sizes(shape, cluster, cons, tp, pp)
                if not experts:
                    continue
                splits = layer_splits(L, pp)
                if fujii or not cons.uneven:
                    splits = [sp_ for sp_ in splits if sp_[0] is None]
                for first, last, stages in splits:
                    if pp == 1:
                        vpps = [1]
                    else:
                        g = 0
                        for n in stages:
                            g = math.gcd(g, n)
                        vpps = list(divisors(g))
                    if fujii:
                        vpps = [1]
                    vpps = _allowed(vpps, cons.vpp)
                    if not vpps:
                        continue
                    per_dp = global_batch_size // dp if global_batch_size % dp == 0 else 0
                    if not per_dp:
                        continue
                    mbss = [b for b in divisors(per_dp) if (cons.mbs is not None or b <= DEFAULT_MAX_MBS)]
                    mbss = _allowed(mbss, cons.mbs)
                    for vpp in vpps:
                        for mbs in mbss:
                            m = per_dp // mbs
                            if vpp > 1 and (m < pp or m % pp):
                                continue       # interleaved schedule: PP <= group (= PP) <= m, no short last group
                            sps = [True, False] if tp > 1 and (s // cp) % tp == 0 else [False]
                            sps = [x for x in sps if (tp == 1 or x in cons.sp)]
                            if fujii and tp > 1:
                                sps = [x for x in sps if x]
                            if shape.moe and tp > 1:
                                sps = [x for x in sps if x]    # MoELayer.forward: TP > 1 trains with SP
                            for ep, etp in experts:
                                for sp in sps:
                                    for rc in recompute:
                                        for dist in dist_opts:
                                            out.append(Candidate(tp, pp, cp, vpp, first, last, sp, mbs, rc, dist, dp,
                                                                 m, stages, ep, etp, moe))
    return out


def make_candidate(shape: ModelShape, cluster: Cluster, global_batch_size: int, tp: int = 1, pp: int = 1,
                   cp: int = 1, vpp: int = 1, mbs: int = 1, recompute: str = "none", sp: bool | None = None,
                   dist_opt: bool = True, first: int | None = None, last: int | None = None, ep: int = 1,
                   etp: int | None = None) -> Candidate:
    """One candidate from explicit values (``--explain``); the split is chosen as the search would."""
    world = cluster.gpus
    if recompute not in RECOMPUTE_LEVELS:
        raise ConfigError("--explain", f"recompute must be one of {', '.join(RECOMPUTE_LEVELS)}, got {recompute!r}")
    if world % (tp * pp * cp):
        raise ConfigError("--explain", f"{world} GPUs are not divisible by TP*PP*CP = {tp}*{pp}*{cp}")
    if cp > 1 and shape.transformer_impl == "local":
        raise ConfigError("--explain", f"cp={cp}: context parallelism needs --transformer-impl transformer_engine "
                          "(megatron-core's local attention asserts CP = 1)")
    dp = world // (tp * pp * cp)
    if global_batch_size % (mbs * dp):
        raise ConfigError("--explain", f"global batch size {global_batch_size} is not divisible by MBS*DP = {mbs}*{dp}")
    if first is None and last is None:
        splits = layer_splits(shape.num_layers, pp)
        if not splits:
            raise ConfigError("--explain", f"{shape.num_layers} layers cannot be split over {pp} pipeline stages")
        first, last, stages = splits[0]
    else:
        rest = shape.num_layers - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        if middle < 0 or (middle and rest % middle) or rest < 0 or bool(middle) != bool(rest):
            raise ConfigError("--explain", f"first/last stage layers {first}/{last} leave {rest} layers for {middle} stages")
        mid = rest // middle if middle else 0
        stages = tuple([first if first is not None else mid] + [mid] * (pp - 2) + [last if last is not None else mid]) \
            if pp > 1 else (shape.num_layers,)
    seq_rank = shape.seq_length // cp
    if sp and tp > 1 and seq_rank % tp:
        raise ConfigError("--explain", f"sequence parallelism splits the {seq_rank} tokens per CP rank over TP = {tp} "
                          "ranks: they must divide (or give sp=off)")
    sp = (tp > 1 and seq_rank % tp == 0) if sp is None else (sp and tp > 1)
    if pp == 1:
        vpp = 1                    # Megatron ignores virtual stages without a pipeline
    etp = tp if etp is None else etp
    if shape.moe is not None:
        from .moe import expert_grid_problem
        why = expert_grid_problem(world, pp, ep, etp, shape.moe.experts)
        if why:
            raise ConfigError("--explain", why)
    elif ep != 1:
        raise ConfigError("--explain", f"ep={ep}: the model has no experts")
    return Candidate(tp, pp, cp, vpp, first, last, sp, mbs, recompute, dist_opt, dp,
                     global_batch_size // (mbs * dp), stages, ep, etp if shape.moe else 1, shape.moe is not None)
