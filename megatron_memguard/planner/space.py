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
(ETP in {1, TP} unless given); with gated delta net layers both GDN head counts divide by TP (TP x CP from
megatron-core 0.18, CP = 1 before: TransformerConfig). Every candidate the planner estimates or shows is then resolved by
:func:`megatron_memguard.resolve.resolve`, which checks all of Megatron's rules again; a candidate
it rejects is counted and dropped.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..config import RawConfig
from ..divisors import divisors
from ..errors import ConfigError
from ..gpus import GpuSpec
from ..knobs import RECOMPUTE_LEVELS  # noqa: F401 (defined with the knobs; re-exported)
from ..layout import DTYPE_BYTES, Layout
from ..tokenizers import pad_vocab
from .moe import MoeShape, moe_dense_params_per_rank, moe_matmul_params, moe_shape_from_args

# Default micro-batch sizes tried: every divisor of GBS/DP up to this bound (--mbs overrides).
DEFAULT_MAX_MBS = 16
# Virtual-pipeline sizes tried on uneven splits (uneven_vpp_splits) when --vpp is not given: the interleaved
# schedule's common setting, which keeps the search bounded (--vpp lists others).
DEFAULT_UNEVEN_VPP = (2,)
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
    "microbatch_group_size_per_vp_stage", "use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy",
    "expert_model_parallel_size", "expert_tensor_parallel_size",
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
    fsdp: tuple[str, ...] = ()     # Megatron-FSDP strategies to try besides DDP (--fsdp); none by default
    # FP8: (None,) keeps the model config's precision; with --fp8 RECIPE ("off", RECIPE) searches both
    fp8: tuple[str | None, ...] = (None,)
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
    """The model as the planner's time model and memory bound need it: the probe layout (resolved at
    TP = PP = CP = 1) read under the short names the planner's formulas use, with the parameter counts
    and weight shapes of the estimator's layer recipes (``estimator.layers``), so that the planner and
    the estimator count the same model."""

    layout: Layout                 # the probe: the model alone, TP = PP = CP = 1
    pad_vocab: bool = True         # --no-pad-vocab-size not given: the vocabulary is padded per TP
    fixed_padded_vocab: int | None = None   # a padded vocabulary the config fixes
    moe: MoeShape | None = None    # mixture of experts (planner/moe.py); None: every layer dense
    # --num-distributed-optimizer-instances as configured (the probe, one GPU, resolves with 1; HSDP)
    instances: int = 1
    # hybrid / heterogeneous models: every layer's kind (partition.layer_kinds, the FP8 recipe left out: the candidate
    # sets it); () when the layers are alike, or differ only in MoE / GDN (the fields above say how)
    kinds: tuple = ()
    # a hybrid pattern's '|' pipeline segments as the user gave them (layers per segment); () without '|'
    segments: tuple[int, ...] = ()
    _per_tp: dict = field(default_factory=dict, compare=False, repr=False)   # memo of per-TP counts

    # ---- the model shape, under the planner's names --------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def hidden(self) -> int:
        return self.layout.hidden_size

    @property
    def ffn(self) -> int:
        return self.layout.ffn_hidden_size

    @property
    def heads(self) -> int:
        return self.layout.num_attention_heads

    @property
    def groups(self) -> int:
        return self.layout.num_query_groups

    @property
    def kv_channels(self) -> int:
        return self.layout.kv_channels

    @property
    def vocab(self) -> int:
        """The vocabulary before padding."""
        return self.layout.vocab_size or self.layout.padded_vocab_size

    @property
    def vocab_divisible_by(self) -> int:
        return self.layout.make_vocab_size_divisible_by

    @property
    def gated(self) -> bool:
        return self.layout.gated_linear_unit

    @property
    def untied(self) -> bool:
        return self.layout.untie_embeddings_and_output_weights

    @property
    def learned_positions(self) -> bool:
        return self.layout.position_embedding_type == "learned_absolute"

    @property
    def max_positions(self) -> int:
        return self.layout.max_position_embeddings

    @property
    def normalization(self) -> str:
        return self.layout.normalization

    @property
    def add_bias_linear(self) -> bool:
        return self.layout.add_bias_linear

    @property
    def add_qkv_bias(self) -> bool:
        return self.layout.add_qkv_bias

    @property
    def qk_layernorm(self) -> bool:
        return self.layout.qk_layernorm

    @property
    def seq_length(self) -> int:
        return self.layout.seq_length

    @property
    def recompute_modules(self) -> tuple[str, ...]:
        return self.layout.recompute_modules

    @property
    def transformer_impl(self) -> str:
        return self.layout.transformer_impl

    @property
    def rope(self) -> bool:
        return self.layout.position_embedding_type in ("rope", "yarn")

    @property
    def fp32_logits(self) -> bool:
        """Cross entropy on an fp32 copy of the logits: always in megatron-core, which ignores
        --fp16-lm-cross-entropy (estimator/head.py output_items)."""
        return True

    @property
    def unfused_attention(self) -> bool:
        """The s x s scores are materialised (local spec, or --attention-backend unfused)."""
        return self.layout.transformer_impl == "local" or self.layout.attention_backend in ("unfused", "local")

    @property
    def fused_cross_entropy(self) -> bool:
        return bool(self.layout.cross_entropy_loss_fusion)

    @property
    def mask_in_dataloader(self) -> bool:
        """--create-attention-mask-in-dataloader (Megatron's default): a [b, 1, s, s] bool mask per batch."""
        return bool(self.layout.create_attention_mask_in_dataloader)

    @property
    def mla(self) -> tuple[int, int, int, int, int] | None:
        """Multi-latent attention: (q_lora_rank or 0, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim)."""
        L = self.layout
        return ((L.q_lora_rank or 0, L.kv_lora_rank, L.qk_head_dim, L.qk_pos_emb_head_dim, L.v_head_dim)
                if L.multi_latent_attention else None)

    # ---- precision and optimizer ----------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return self.layout.param_bytes

    @property
    def act_bytes(self) -> int:
        return self.layout.act_bytes

    @property
    def grad_bytes(self) -> int:
        L = self.layout
        return 2 if (L.use_precision_aware_optimizer and L.main_grads_dtype == "bf16") else L.grad_bytes

    @property
    def optimizer(self) -> str:
        return self.layout.optimizer

    @property
    def optimizer_state_bytes(self) -> float:
        """fp32 main params + moments per parameter (before DP sharding)."""
        L = self.layout
        if L.use_precision_aware_optimizer:
            main = 0 if L.params_dtype == "fp32" else (
                2 if (L.store_param_remainders and L.params_dtype == "bf16" and L.main_params_dtype == "fp32")
                else DTYPE_BYTES[L.main_params_dtype])
            return main + DTYPE_BYTES[L.exp_avg_dtype] + (DTYPE_BYTES[L.exp_avg_sq_dtype] if L.optimizer == "adam" else 0)
        main = 0 if L.params_dtype == "fp32" else 4
        # SOAP: fp32 exp_avg and exp_avg_sq of its matrices, Adam's two moments for the rest (estimator/muon.py);
        # its preconditioners depend on each matrix's shape (soap_factor_bytes)
        return main + (8 if L.optimizer in ("adam", "soap") else 4)

    def soap_factor_bytes(self, tp: int, moe_layer: bool = False) -> int:
        """SOAP's Kronecker factors and eigenbases of one layer's matrices on one TP rank (8 (m^2 + n^2) B per
        [m, n] weight, estimator/muon.py soap_factor_bytes); for an MoE layer only its token mixer's (a lower
        bound). 0 for other optimizers."""
        if self.layout.optimizer != "soap":
            return 0
        key = ("soap", tp, moe_layer)
        hit = self._per_tp.get(key)
        if hit is None:
            from ..estimator.layers import mixer_recipe, mlp_recipe
            from ..estimator.muon import soap_factor_bytes, takes_muon_by_name
            from ..partition import uniform_kind
            L, kind = self.layout_at_tp(tp), uniform_kind(self.layout)
            ps = mixer_recipe(kind).params(L, "") + ([] if moe_layer else mlp_recipe(kind).params(L, ""))
            hit = self._per_tp[key] = sum(soap_factor_bytes(p.numel // p.cols, p.cols) for p in ps
                                          if p.cols and takes_muon_by_name(p.name))
        return hit

    @property
    def dist_opt_instances(self) -> int:
        return max(1, self.instances)

    @property
    def qk_dim(self) -> int:
        """Head dim of queries and keys (MLA: the content and rope parts), from the mixer's recipe."""
        return self._mixer.head_dims(self.layout)[0]

    @property
    def v_dim(self) -> int:
        return self._mixer.head_dims(self.layout)[1]

    @property
    def _mixer(self):
        from ..estimator.layers import mixer_recipe
        from ..partition import uniform_kind
        return mixer_recipe(uniform_kind(self.layout))

    def padded_vocab(self, tp: int) -> int:
        if self.fixed_padded_vocab:
            return self.fixed_padded_vocab
        return pad_vocab(self.vocab, self.vocab_divisible_by, tp) if self.pad_vocab else self.vocab

    def kv_heads_per_rank(self, tp: int) -> int:
        """Query groups on one TP rank (replicated when TP > groups)."""
        return max(1, self.groups // tp)

    # ---- counts from the layer recipes -----------------------------------------------------------
    def layout_at_tp(self, tp: int) -> Layout:
        """The probe with TP = ``tp`` (what the recipes need for per-rank shapes)."""
        key = ("layout", tp)
        hit = self._per_tp.get(key)
        if hit is None:
            hit = self._per_tp[key] = self.layout if tp == self.layout.tp else self.layout.replace(
                tensor_model_parallel_size=tp)
        return hit

    def layer_params_per_rank(self, tp: int) -> int:
        """Parameters of one transformer layer on one TP rank: the recipes' parameter list
        (sharded weights / TP, replicated norms and down projections)."""
        from ..estimator.params import layer_params
        key = ("params", tp)
        hit = self._per_tp.get(key)
        if hit is None:
            hit = self._per_tp[key] = sum(p.numel for p in layer_params(self.layout_at_tp(tp)))
        return hit

    def layer_matmul_params(self) -> int:
        """Weights of one layer that multiply an activation (the '6N' of the FLOP count): every linear
        weight of the recipes, whole (the probe has TP = 1)."""
        from ..estimator.params import layer_linear_shapes
        return sum(out * inp for out, inp in layer_linear_shapes(self.layout_at_tp(1)).values())

    def matmul_params(self) -> int:
        """Weights a token multiplies in all the layers: the dense layers', and in an MoE layer the
        attention, router, top-k experts and shared expert; a GDN layer's in_proj / out_proj instead of
        linear_qkv / linear_proj."""
        if self.kinds:
            return sum(n * self.kind_matmul_params(k) for k, n in zip(self.kind_set, self.kinds_in(0, self.num_layers)))
        gdn = self.gdn_layers * (self.gdn_layer_matmul_params() - self.layer_matmul_params())
        if not self.moe:
            return self.num_layers * self.layer_matmul_params() + gdn
        n_moe = self.moe.moe_layers
        dense = self.layer_matmul_params()
        moe = dense - self.dense_mlp_matmul_params() + moe_matmul_params(self.moe, self.hidden, self.gated)
        return (self.num_layers - n_moe) * dense + n_moe * moe + gdn

    # ---- gated delta net layers (--linear-attention-freq) ------------------------------------------
    @property
    def gdn_pattern(self) -> str:
        """One character per layer, '1' a GDN layer, '0' standard attention; "" without GDN layers (and for a
        hybrid model, whose 'G' layers are one of its kinds)."""
        return "" if self.kinds else (self.layout.linear_attention_pattern or "")

    @property
    def gdn_layers(self) -> int:
        return self.gdn_pattern.count("1")

    def gdn_layers_in(self, first: int, count: int) -> int:
        """GDN layers among global layers [first, first + count)."""
        return self.gdn_pattern[first:first + count].count("1")

    @property
    def _gdn_kind(self):
        from ..partition import MIXER_GDN, MLP_DENSE, LayerKind
        return LayerKind(MIXER_GDN, MLP_DENSE, None)

    def gdn_layer_params_per_rank(self, tp: int) -> int:
        """Parameters of one dense layer with a GDN mixer on one TP rank (the estimator's recipe)."""
        from ..estimator.params import layer_params
        key = ("gdn_params", tp)
        hit = self._per_tp.get(key)
        if hit is None:
            hit = self._per_tp[key] = sum(p.numel for p in layer_params(self.layout_at_tp(tp), kind=self._gdn_kind))
        return hit

    def gdn_layer_matmul_params(self) -> int:
        """Linear weights of one dense GDN layer, whole: in_proj, out_proj, fc1, fc2."""
        from ..estimator.params import layer_linear_shapes
        return sum(o * i for o, i in layer_linear_shapes(self.layout_at_tp(1), self._gdn_kind).values())

    def gdn_activation_bound(self, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
        """What a GDN mixer surely keeps per micro-batch (the estimator recipe's bound_saved)."""
        from ..estimator.layers import mixer_recipe
        return mixer_recipe(self._gdn_kind).bound_saved(self.layout, tp, b, seq, sp, mods)

    # ---- layers of several kinds (hybrid Mamba models, heterogeneous layer configs; planner/hybrid.py) ----
    @property
    def kind_set(self) -> tuple:
        """The distinct kinds of :attr:`kinds`, in the order they first appear."""
        hit = self._per_tp.get("kind_set")
        if hit is None:
            hit = self._per_tp["kind_set"] = tuple(dict.fromkeys(self.kinds))
        return hit

    def kinds_in(self, first: int, count: int) -> tuple[int, ...]:
        """How many layers of each kind of :attr:`kind_set` global layers [first, first + count) have."""
        pre = self._per_tp.get("kind_prefix")
        if pre is None:
            index = {k: i for i, k in enumerate(self.kind_set)}
            rows, row = [], [0] * len(index)
            rows.append(tuple(row))
            for k in self.kinds:
                row[index[k]] += 1
                rows.append(tuple(row))
            pre = self._per_tp["kind_prefix"] = rows
        lo, hi = pre[first], pre[min(first + count, len(pre) - 1)]
        return tuple(b - a for a, b in zip(lo, hi))

    def kind_params_per_rank(self, kind, tp: int) -> int:
        """Parameters of one layer of ``kind`` on one TP rank outside the routed experts (the estimator's recipes;
        the experts: TimeModel.stage_expert_params)."""
        key = ("kind_params", kind, tp)
        hit = self._per_tp.get(key)
        if hit is None:
            from ..estimator.params import layer_param_rows
            hit = self._per_tp[key] = sum(r[1] for r in layer_param_rows(self.layout_at_tp(tp), kind) if not r[4])
        return hit

    def kind_matmul_params(self, kind) -> int:
        """Weights a token multiplies in one layer of ``kind`` (whole): its mixer's and MLP's linears; an MoE block's
        router, top-k experts and shared expert."""
        from ..estimator.layers import kind_layout, mixer_recipe, mlp_recipe
        from ..partition import MLP_MOE
        L = kind_layout(self.layout_at_tp(1), kind)
        n = sum(o * i for o, i in mixer_recipe(kind).linear_shapes(L).values())
        if kind.mlp == MLP_MOE:
            return n + moe_matmul_params(self.moe, self.hidden, self.gated)
        return n + sum(o * i for o, i in mlp_recipe(kind).linear_shapes(L).values())

    def kind_activation_bound(self, kind, tp: int, b: int, seq: int, sp: bool, mods: set) -> tuple[int, int]:
        """(mixer, MLP) bytes a layer of ``kind`` surely keeps per micro-batch (its recipes' bound_saved)."""
        from ..estimator.layers import kind_layout, mixer_recipe, mlp_recipe
        L = kind_layout(self.layout, kind)
        return (mixer_recipe(kind).bound_saved(L, tp, b, seq, sp, mods),
                mlp_recipe(kind).bound_saved(L, tp, b, seq, sp, mods))

    def dense_mlp_matmul_params(self) -> int:
        """The dense MLP's weights of one layer: fc1 [g f, h] and fc2 [h, f]."""
        return ((2 if self.gated else 1) + 1) * self.ffn * self.hidden

    def moe_layer_params_per_rank(self, tp: int) -> int:
        """Parameters of one MoE layer on one rank outside the expert grid: the attention and norms of
        :meth:`layer_params_per_rank` without its dense MLP, plus the router and shared expert."""
        f = self.ffn
        mlp = ((2 if self.gated else 1) * f * self.hidden + f * self.hidden) // tp
        if self.add_bias_linear:
            mlp += self.hidden + (2 if self.gated else 1) * f // tp
        return self.layer_params_per_rank(tp) - mlp + moe_dense_params_per_rank(self.moe, self.hidden, self.gated, tp)


def model_shape(L: Layout, raw: RawConfig, segments: tuple[int, ...] = ()) -> ModelShape:
    """The shape of the model from a probe layout resolved at TP=PP=CP=1; ``segments``: the layers of each '|'
    segment of the user's hybrid pattern (taken out of ``raw`` for the probe)."""
    kinds: tuple = ()
    moe = moe_shape_from_args(raw.args, L.num_layers, L.ffn_hidden_size)
    if L.heterogeneous_layers or L.hybrid_layer_pattern:
        # layers of several kinds (planner/hybrid.py): each layer's kind as the estimator builds it
        from ..partition import MLP_MOE, layer_kinds
        if L.mtp_num_layers and not L.hybrid_layer_pattern:
            # (a hybrid model's MTP depths are its '/' pattern's layers, planned: TimeModel.mtp_cost)
            from ..errors import NotModelledError
            raise NotModelledError("--mtp-num-layers", "planning layouts of heterogeneous models with "
                                   "multi-token prediction depths")
        kinds = tuple(k._replace(quantized=None) for k in layer_kinds(L))
        if moe is not None:
            # the MoE layers are the pattern's 'E' layers (the blocks' MoE MLPs), not --moe-layer-freq's
            from dataclasses import replace as _replace
            moe = _replace(moe, pattern=tuple(k.mlp == MLP_MOE for k in kinds))
    fixed_padded = raw.args.get("padded_vocab_size")
    pad = raw.args.get("pad_vocab_size", True)
    if isinstance(pad, str):
        pad = pad.strip().lower() in ("1", "true", "yes", "on")
    inst = raw.args.get("num_distributed_optimizer_instances")
    return ModelShape(layout=L, pad_vocab=bool(pad), fixed_padded_vocab=int(fixed_padded) if fixed_padded else None,
                      moe=moe, instances=int(inst) if inst not in (None, "") else L.num_distributed_optimizer_instances,
                      kinds=kinds, segments=tuple(segments))


@dataclass(frozen=True, init=False)
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
    fsdp: str | None = None        # Megatron-FSDP sharding strategy, None: DDP
    fp8: str | None = None         # None: as the model config says; "off"; or the FP8 recipe (--fp8)
    acc_emb: bool = False          # --account-for-embedding-in-pipeline-split
    acc_loss: bool = False         # --account-for-loss-in-pipeline-split
    pp_layout: str | None = None   # --pipeline-model-parallel-layout (VPP = its stages / PP)
    # layers of each virtual stage, index v * PP + rank (Megatron's global order); () when it follows from
    # stage_layers (one chunk per rank, or the even split)
    chunks: tuple[int, ...] = field(compare=False, hash=False, default=())
    # a hybrid model's split as Megatron 0.17+ spells it: the --hybrid-layer-pattern with '|' between the PP x VPP
    # segments (validate_args derives VPP from their count), its '/' MTP depths after them; None: no '|'
    segments: str | None = None

    def __init__(self, tp: int, pp: int, cp: int, vpp: int, first: int | None, last: int | None, sp: bool, mbs: int,
                 recompute: str, dist_opt: bool, dp: int, m: int, stage_layers: tuple[int, ...] = (), ep: int = 1,
                 etp: int = 1, moe: bool = False, fsdp: str | None = None, fp8: str | None = None,
                 acc_emb: bool = False, acc_loss: bool = False, pp_layout: str | None = None,
                 chunks: tuple[int, ...] = (), segments: str | None = None) -> None:
        # the fields in the instance dict directly: the generated frozen __init__ calls object.__setattr__ per
        # field, and a search makes tens of thousands of candidates (a third of DeepSeek-V3's plan went there)
        d = self.__dict__
        d["tp"] = tp
        d["pp"] = pp
        d["cp"] = cp
        d["vpp"] = vpp
        d["first"] = first
        d["last"] = last
        d["sp"] = sp
        d["mbs"] = mbs
        d["recompute"] = recompute
        d["dist_opt"] = dist_opt
        d["dp"] = dp
        d["m"] = m
        d["stage_layers"] = stage_layers
        d["ep"] = ep
        d["etp"] = etp
        d["moe"] = moe
        d["fsdp"] = fsdp
        d["fp8"] = fp8
        d["acc_emb"] = acc_emb
        d["acc_loss"] = acc_loss
        d["pp_layout"] = pp_layout
        d["chunks"] = chunks
        d["segments"] = segments

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
        if self.acc_emb or self.acc_loss:
            s += ",account=" + "+".join(w for w, on in (("embedding", self.acc_emb), ("loss", self.acc_loss)) if on)
        if self.pp_layout:
            s += f",layout={self.pp_layout}"
        if self.segments:
            s += f",segments={self.segments}"
        if self.fsdp:
            s += f",fsdp={self.fsdp}"
        if self.fp8 is not None:
            s += f",fp8={self.fp8}"
        if self.moe:
            s += f",ep={self.ep},etp={self.etp}"
        return s

    @property
    def label(self) -> str:
        """Human spelling for tables: TP8 PP4 (VPP5) CP1 SP MBS1 ..."""
        parts = [f"TP{self.tp}", f"PP{self.pp}" + (f"x{self.vpp}v" if self.vpp > 1 else ""), f"CP{self.cp}"]
        if self.first is not None or self.last is not None:
            parts[1] += f"[{self.first}|..|{self.last}]"
        elif self.pp_layout or self.acc_emb or self.acc_loss or self.segments:
            parts[1] += f"[{self.stage_layers[0]}|..|{self.stage_layers[-1]}]"
        parts.append(f"DP{self.dp}")
        if self.moe:
            parts.append(f"EP{self.ep}" + (f" ETP{self.etp}" if self.etp != self.tp else ""))
        parts.append(f"MBS{self.mbs}")
        if self.tp > 1:
            parts.append("SP" if self.sp else "noSP")
        parts.append({"none": "", "selective": "sel-rc", "full": "full-rc"}[self.recompute])
        parts.append("" if self.dist_opt else "no-distopt")
        if self.fsdp:
            parts.append("FSDP-" + "".join(w[0] for w in self.fsdp.split("_")))
        if self.fp8 not in (None, "off"):
            parts.append(f"FP8-{self.fp8}")
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
        if self.pp_layout:
            o["pipeline_model_parallel_layout"] = self.pp_layout    # (it sets VPP: no VPP flag beside it)
        elif self.segments:
            # the pattern's '|' segments set PP's split and VPP (validate_args); the legacy spelling left out
            o.update(hybrid_layer_pattern=self.segments, hybrid_override_pattern=None)
        elif self.vpp > 1:
            o["num_virtual_stages_per_pipeline_rank"] = self.vpp
        if self.acc_emb:
            o["account_for_embedding_in_pipeline_split"] = True
        if self.acc_loss:
            o["account_for_loss_in_pipeline_split"] = True
        if self.first is not None:
            o["decoder_first_pipeline_num_layers"] = self.first
        if self.last is not None:
            o["decoder_last_pipeline_num_layers"] = self.last
        if self.recompute == "selective":
            o["recompute_granularity"] = "selective"
        elif self.recompute == "full":
            o.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if self.fsdp:
            # Megatron-FSDP over its own buffers with the distributed optimizer (validate_args switches
            # it on in 0.19, and wants the fsdp_dtensor checkpoint format)
            o.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=self.fsdp, use_distributed_optimizer=True,
                     overlap_param_gather=True, ckpt_format="fsdp_dtensor")
        if self.fp8 == "off":
            o.update(fp8=None, fp4=None, fp8_param_gather=False, fp4_param_gather=False)
        elif self.fp8 is not None:
            # Megatron-Bridge's presets use e4m3 for MXFP8 and the hybrid format for the other recipes
            o.update(fp8="e4m3" if self.fp8 == "mxfp8" else "hybrid", fp8_recipe=self.fp8, fp4=None)
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


@dataclass(frozen=True)
class VppSplit:
    """An uneven split with virtual stages: one of Megatron's three spellings of it."""

    vpp: int
    stages: tuple[int, ...]                  # layers per pipeline rank
    chunks: tuple[int, ...]                  # layers per virtual stage, index v * PP + rank
    first: int | None = None                 # --decoder-first/last-pipeline-num-layers
    last: int | None = None
    acc_emb: bool = False                    # --account-for-embedding/loss-in-pipeline-split
    acc_loss: bool = False
    layout: str | None = None                # --pipeline-model-parallel-layout
    segments: str | None = None              # a hybrid pattern with '|' (Candidate.segments)


def flag_chunks(stages: tuple[int, ...], vpp: int) -> tuple[int, ...]:
    """Layers per virtual stage of a first/last split: each rank's layers / VPP in every chunk (megatron-core's
    ``get_transformer_layer_offset``), index v * PP + rank."""
    return tuple(n // vpp for _ in range(vpp) for n in stages)


def _ranks(chunks: list[int], pp: int) -> tuple[int, ...]:
    return tuple(sum(chunks[r::pp]) for r in range(pp))


def _layout_text(chunks: list[int], mtp: int) -> str:
    """Megatron's layout syntax for per-virtual-stage layer counts: 'E' on the first stage, MTP layers and
    'L' on the last, equal neighbouring stages folded as ``(tt|)*30``, runs of layers as ``t*8``."""
    stages = [("E" if i == 0 else "") + ("t" * n if n < 3 else f"t*{n}") + ("m" * mtp + "L" if i == len(chunks) - 1 else "")
              for i, n in enumerate(chunks)]
    text, i = "", 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[i]:
            j += 1
        k = j - i + 1
        text += f"({stages[i]}|)*{k}" if k > 1 else stages[i] + "|"
        i = j + 1
    return text[:-1]


def uneven_vpp_splits(num_layers: int, pp: int, vpp: int, mtp: int = 0) -> list[VppSplit]:
    """The uneven splits of (layers, PP, VPP, MTP): see ``_uneven_vpp_splits`` (computed once per argument set:
    the search asks again for every TP and CP)."""
    return list(_uneven_vpp_splits(num_layers, pp, vpp, mtp))


@functools.lru_cache(maxsize=1024)
def _uneven_vpp_splits(num_layers: int, pp: int, vpp: int, mtp: int = 0) -> tuple[VppSplit, ...]:
    """Splits with ``vpp`` virtual stages where the even one is refused (PP x VPP does not divide the layers),
    in the spellings megatron-core 0.16.1 accepts (``TransformerConfig.__post_init__``):

    * first/last stage sizes: each > 0 and divisible by VPP, the middle layers dividing over the middle
      stages into multiples of VPP; a middle stage a multiple of VPP next to L/PP, the ends no larger than
      L/PP rounded up to a multiple of VPP (nearly balanced, both orders);
    * else ``--account-for-embedding/loss-in-pipeline-split``: L + 1 or L + 2 slots dividing into PP x VPP;
    * else ``--pipeline-model-parallel-layout``: the L + 2 slots (embedding and loss counted as a layer, as
      DeepSeek-V3's ``Et|(tt|)*30L`` for 61 layers on PP16 x VPP2 does) dealt over the PP x VPP stages, the
      short stages first the last and the first one, then the others spread over the ranks.

    At most three candidates per (PP, VPP): the search stays bounded."""
    L, S = num_layers, pp * vpp
    if pp < 2 or vpp < 2 or L % S == 0 or L < S // 2:
        return ()
    out: list[VppSplit] = []
    cap = -(-(-(-L // pp)) // vpp) * vpp             # ceil(L/PP) rounded up to a multiple of VPP
    for mid in (sorted({(L // pp) // vpp * vpp, -(-(L // pp) // vpp) * vpp}) if pp > 2 else [0]):
        rest = L - (pp - 2) * mid
        a = rest // 2 // vpp * vpp
        if (pp > 2 and mid < vpp) or a < vpp or (rest - a) % vpp or rest - a > cap:
            continue
        for first, last in {(a, rest - a), (rest - a, a)}:
            per = [first] + [mid] * (pp - 2) + [last]
            out.append(VppSplit(vpp, tuple(per), flag_chunks(tuple(per), vpp), first=first, last=last))
    out = sorted(out, key=lambda x: x.stages)
    for e, l in ((1, 1), (1, 0), (0, 1)):
        n = L + e + l
        if n % S == 0 and n // S >= 1:
            ch = [n // S] * S
            ch[0] -= e
            ch[-1] -= l
            out.append(VppSplit(vpp, _ranks(ch, pp), tuple(ch), acc_emb=bool(e), acc_loss=bool(l)))
            break
    if out:
        return tuple(out)
    q, r = divmod(L + 2, S)
    if q < 1:
        return ()
    # the S - r short stages: the last, the first, then one per rank from the middle ranks outwards
    order = [S - 1, 0]
    taken = set(order)             # (a set: PP x VPP reaches 10**5 stages, a scan of the list per stage hung)
    for v in range(vpp - 1, -1, -1):
        for k in range(pp - 1):
            rank = (pp - 2 - k // 2) if k % 2 == 0 else (1 + k // 2)
            i = v * pp + rank
            if i not in taken:
                taken.add(i)
                order.append(i)
    slots = [q + 1] * S
    for i in order[:S - r]:
        slots[i] = q
    ch = list(slots)
    ch[0] -= 1
    ch[-1] -= 1
    if min(ch) < 0:
        return ()
    return (VppSplit(vpp, _ranks(ch, pp), tuple(ch), layout=_layout_text(ch, mtp)),)


def hybrid_pipes(shape: ModelShape) -> bool:
    """A hybrid pattern may carry '|' pipeline segments: megatron-core 0.17 and later (validate_args derives VPP from
    their count; 0.16.1's MambaStack._select_layers_for_pipeline_parallel asserts no virtual pipeline, and its
    pattern has no '|' symbol)."""
    from packaging.version import Version
    return Version(str(shape.layout.megatron_version)) >= Version("0.17")


@functools.lru_cache(maxsize=4096)
def _segment_text(pattern: str, chunks: tuple[int, ...], suffix: str) -> str:
    out, at = [], 0
    for n in chunks:
        out.append(pattern[at:at + n])
        at += n
    return "|".join(out) + suffix


def segment_text(shape: ModelShape, chunks: tuple[int, ...]) -> str:
    """The model's hybrid pattern cut into '|' segments of ``chunks`` layers (index v x PP + rank, the order of
    select_pipeline_segment's segment_index), its '/' MTP depths after them (parse_hybrid_pattern)."""
    L = shape.layout
    suffix = ("/" + L.hybrid_mtp_pattern) * L.mtp_num_layers if L.hybrid_mtp_pattern else ""
    return _segment_text(L.hybrid_layer_pattern, tuple(chunks), suffix)


def hybrid_given_options(shape: ModelShape, pp: int, cons: Constraints, fujii: bool) -> list[tuple]:
    """The user's '|' segments as the only split on ``pp`` ranks: their count divisible by PP, VPP = count / PP
    (validate_args, 0.19.2; select_pipeline_segment gives segment v x PP + rank to rank ``rank``, virtual stage
    ``v``); PP > 1 (the interleaved schedule needs a pipeline). An option as enumerate_pruned lists them."""
    seg = shape.segments
    if len(seg) % pp or pp == 1:
        return []
    v = len(seg) // pp
    if (cons.vpp is not None and v not in cons.vpp) or (fujii and v > 1):
        return []
    stages = _ranks(list(seg), pp)
    return [(None, None, stages, [v], VppSplit(v, stages, tuple(seg) if v > 1 else (),
                                               segments=segment_text(shape, tuple(seg))))]


def hybrid_vpp_options(shape: ModelShape, pp: int, cons: Constraints) -> list[tuple]:
    """Virtual stages of a hybrid pattern without '|' (which megatron-core refuses: select_pipeline_segment raises
    for a vp_stage without '|'): the planner's own split written as '|' segments, PP x VPP of them. The even split
    with every VPP dividing L / PP, and where PP x VPP does not divide the layers the chunks of
    :func:`uneven_vpp_splits` (VPP 2 or --vpp), each as segments."""
    L = shape.num_layers
    out: list[tuple] = []
    if L % pp == 0:
        per = L // pp
        for v in _allowed([v for v in divisors(per) if v > 1], cons.vpp):
            stages = (per,) * pp
            text = segment_text(shape, (per // v,) * (pp * v))
            out.append((None, None, stages, [v], VppSplit(v, stages, (), segments=text)))
    if not cons.uneven:
        return out
    seen: set = set()
    for v in (cons.vpp if cons.vpp is not None else DEFAULT_UNEVEN_VPP):
        for x in uneven_vpp_splits(L, pp, v):
            if x.chunks in seen:
                continue
            seen.add(x.chunks)
            text = segment_text(shape, x.chunks)
            out.append((None, None, x.stages, [v], VppSplit(v, x.stages, x.chunks, segments=text)))
    return out


def _allowed(values: Iterable[int], allowed: tuple[int, ...] | None) -> list[int]:
    return [v for v in values if allowed is None or v in allowed]


def gdn_heads_ok(shape: ModelShape, tp: int, cp: int) -> bool:
    """TransformerConfig's rules for GDN layers: key and value heads divide by TP (megatron-core 0.16, 0.17:
    and CP = 1) or by TP x CP (0.18+, where CP is an all-to-all of heads; GatedDeltaNet splits them so)."""
    from packaging.version import Version
    from .gdn import gdn_shape
    new = Version(str(shape.layout.megatron_version)) >= Version("0.18")
    return gdn_shape(shape.layout).heads_split_ok(tp, cp, cp_splits_heads=new)


def mixed_heads_ok(shape: ModelShape, tp: int, cp: int) -> bool:
    """A hybrid model's rules on its Mamba heads and groups (MambaMixer, MambaContextParallel) and its 'G' layers'
    GDN heads (as gdn_heads_ok), where it has such layers."""
    from ..partition import MIXER_GDN, MIXER_MAMBA
    mixers = {k.mixer for k in shape.kind_set}
    if MIXER_MAMBA in mixers:
        from .hybrid import mamba_shape
        if not mamba_shape(shape.layout).heads_split_ok(tp, cp):
            return False
    if MIXER_GDN in mixers:
        from packaging.version import Version
        from .gdn import gdn_shape
        new = Version(str(shape.layout.megatron_version)) >= Version("0.18")
        return gdn_shape(shape.layout).heads_split_ok(tp, cp, cp_splits_heads=new)
    return True


def tp_values(shape: ModelShape, cluster: Cluster, cons: Constraints) -> list[int]:
    """TP sizes: divisors of the GPU count that the heads and query groups allow, inside a node
    (dividing the GPUs per node, or the NVLink domain) unless TP may span nodes."""
    out = []
    dom = min(cluster.tp_domain, cluster.gpus)
    for t in divisors(cluster.gpus):
        if shape.heads % t or (shape.groups % t and t % shape.groups):
            continue
        if shape.gdn_pattern and not gdn_heads_ok(shape, t, 1):
            continue                   # GatedDeltaNet splits its key and value heads over TP
        if shape.kinds and not mixed_heads_ok(shape, t, 1):
            continue                   # MambaMixer / GatedDeltaNet split their heads over TP
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


_NO_SPLIT_FLAGS = (False, False, None, (), None)    # a candidate's acc_emb, acc_loss, pp_layout, chunks, segments: none


def enumerate_space(shape: ModelShape, cluster: Cluster, global_batch_size: int, cons: Constraints,
                    rule: str = "time") -> list[Candidate]:
    """Every candidate allowed by the constraints and the rules known before an estimate.

    ``rule='fujii2024'`` restricts to the space Fujii et al. searched: TP*CP within a node, even
    pipeline splits, plain 1F1B (no VPP), no recomputation, SP whenever TP > 1, the distributed
    optimizer (the constraints can still narrow it further)."""
    return enumerate_pruned(shape, cluster, global_batch_size, cons, rule)[0]


def enumerate_pruned(shape: ModelShape, cluster: Cluster, global_batch_size: int, cons: Constraints,
                     rule: str = "time", prune: Callable[[Candidate], bool] | None = None) -> tuple[list[Candidate], int]:
    """:func:`enumerate_space` without the candidates ``prune`` refuses, and how many those are. ``prune`` sees
    the first candidate (in the order of :func:`enumerate_space`) of each group that differs only in MBS, SP,
    recomputation and FP8, and its answer holds for the whole group: the others of a refused group are counted,
    not built (a mixture-of-experts space has tens of thousands of layouts whose model state alone does not fit:
    Planner.state_bound reads nothing of the four)."""
    fujii = rule == "fujii2024"
    L, s, world = shape.num_layers, shape.seq_length, cluster.gpus
    out: list[Candidate] = []
    pruned = 0
    recompute = [r for r in cons.recompute if r in RECOMPUTE_LEVELS]
    if fujii:
        recompute = [r for r in recompute if r == "none"]
    dist_opts = [d for d in cons.dist_opt if not fujii or d]
    fsdps = [] if fujii else list(cons.fsdp)
    dist_fsdp = [(d, None) for d in dist_opts] + [(True, f) for f in fsdps]     # DDP, then Megatron-FSDP
    moe = shape.moe is not None
    mtp = shape.layout.mtp_num_layers
    hybrid = bool(shape.layout.hybrid_layer_pattern)
    pipes = hybrid and hybrid_pipes(shape)        # '|' segments: the split written into the pattern (0.17+)
    linear_blocks = any("linear" in (k.mixer, k.mlp) for k in shape.kind_set)
    for tp in tp_values(shape, cluster, cons):
        # megatron-core's own attention (--transformer-impl local) asserts CP = 1, TE's unfused attention has
        # none either (resolve/kernels.py); only TE's flash / fused attention does ring attention
        for cp in (divisors(world // tp) if not shape.unfused_attention else [1]):
            if cp > 1 and s % (2 * cp):
                continue
            if cons.cp is None and s // cp < MIN_TOKENS_PER_CP_RANK and cp > 1:
                continue
            if cons.cp is not None and cp not in cons.cp:
                continue
            if shape.gdn_pattern and not gdn_heads_ok(shape, tp, cp):
                continue
            if shape.kinds and not mixed_heads_ok(shape, tp, cp):
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
                splits = layer_splits(L, pp) if not (pipes and shape.segments) else []
                if fujii or not cons.uneven:
                    splits = [sp_ for sp_ in splits if sp_[0] is None]
                options: list[tuple] = []      # (first, last, stages, VPPs, VppSplit or None)
                for first, last, stages in splits:
                    if pp == 1:
                        vpps = [1]
                    else:
                        g = 0
                        for n in stages:
                            g = math.gcd(g, n)
                        vpps = list(divisors(g))
                    if fujii or hybrid:
                        vpps = [1]     # (a hybrid pattern without '|': select_pipeline_segment refuses VPP)
                    vpps = _allowed(vpps, cons.vpp)
                    if vpps:
                        options.append((first, last, stages, vpps, None))
                if pp > 1 and cons.uneven and not fujii and not hybrid:
                    for v in (cons.vpp if cons.vpp is not None else DEFAULT_UNEVEN_VPP):
                        for x in uneven_vpp_splits(L, pp, v, mtp):
                            if not any(o[2] == x.stages and v in o[3] for o in options):
                                options.append((x.first, x.last, x.stages, [v], x))
                if pipes and shape.segments:
                    options = hybrid_given_options(shape, pp, cons, fujii)      # the user's '|' segments, as given
                elif pipes and pp > 1 and not fujii:
                    options += hybrid_vpp_options(shape, pp, cons)             # virtual stages, written as '|'
                for first, last, stages, vpps, xs in options:
                    # (acc_emb, acc_loss, pp_layout, chunks), passed by position: tens of thousands of candidates
                    extra = _NO_SPLIT_FLAGS if xs is None else (xs.acc_emb, xs.acc_loss, xs.layout, xs.chunks,
                                                                xs.segments)
                    per_dp = global_batch_size // dp if global_batch_size % dp == 0 else 0
                    if not per_dp:
                        continue
                    mbss = [b for b in divisors(per_dp) if (cons.mbs is not None or b <= DEFAULT_MAX_MBS)]
                    mbss = _allowed(mbss, cons.mbs)
                    for vpp in vpps:
                        if xs is None and vpp > 1 and first is not None:
                            extra = (False, False, None, flag_chunks(stages, vpp), None)
                        elif xs is None:
                            extra = _NO_SPLIT_FLAGS
                        kept: dict[tuple, bool] = {}     # (EP, ETP, distributed optimizer, FSDP) -> prune's answer
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
                            if linear_blocks and tp > 1:
                                # a heterogeneous block's linear replacement gathers its output, which fails under
                                # SP (resolve/heterogeneous.py)
                                sps = [x for x in sps if not x]
                            for ep, etp in experts:
                                for sp in sps:
                                    for rc in recompute:
                                        for dist, fs in dist_fsdp:
                                            ok = kept.get((ep, etp, dist, fs)) if prune is not None else True
                                            if ok is False:
                                                pruned += len(cons.fp8)
                                                continue
                                            for f8 in cons.fp8:
                                                c = Candidate(tp, pp, cp, vpp, first, last, sp, mbs, rc, dist, dp, m,
                                                              stages, ep, etp, moe, fs, f8, *extra)
                                                if ok is None:
                                                    ok = kept[ep, etp, dist, fs] = not prune(c)
                                                    if not ok:
                                                        pruned += len(cons.fp8)
                                                        break
                                                out.append(c)
    return out, pruned


def make_candidate(shape: ModelShape, cluster: Cluster, global_batch_size: int, tp: int = 1, pp: int = 1,
                   cp: int = 1, vpp: int = 1, mbs: int = 1, recompute: str = "none", sp: bool | None = None,
                   dist_opt: bool = True, first: int | None = None, last: int | None = None, ep: int = 1,
                   etp: int | None = None, fsdp: str | None = None, fp8: str | None = None,
                   layout: str | None = None, acc_emb: bool = False, acc_loss: bool = False,
                   segments: str | None = None) -> Candidate:
    """One candidate from explicit values (``--explain``); the split is chosen as the search would, or
    given as first/last sizes, embedding/loss slots (``acc_emb``/``acc_loss``), a pipeline layout or (hybrid
    models) the pattern with '|' segments."""
    world = cluster.gpus
    if recompute not in RECOMPUTE_LEVELS:
        raise ConfigError("--explain", f"recompute must be one of {', '.join(RECOMPUTE_LEVELS)}, got {recompute!r}")
    if world % (tp * pp * cp):
        raise ConfigError("--explain", f"{world} GPUs are not divisible by TP*PP*CP = {tp}*{pp}*{cp}")
    if cp > 1 and shape.unfused_attention:
        raise ConfigError("--explain", f"cp={cp}: context parallelism needs Transformer Engine's flash or fused "
                          "attention (megatron-core's local attention asserts CP = 1; TE's unfused one has none)")
    dp = world // (tp * pp * cp)
    if global_batch_size % (mbs * dp):
        raise ConfigError("--explain", f"global batch size {global_batch_size} is not divisible by MBS*DP = {mbs}*{dp}")
    chunks: tuple[int, ...] = ()
    if segments is not None:
        if layout is not None or acc_emb or acc_loss or first is not None or last is not None:
            raise ConfigError("--explain", "segments, layout, account and first/last are spellings of the split: give one")
        seg = hybrid_segments(shape, segments, "--explain segments")
        if pp < 2 or len(seg) % pp:
            raise ConfigError("--explain", f"segments: {len(seg)} '|' segments need a PP > 1 that divides their count "
                              f"(validate_args), got pp={pp}")
        vpp = len(seg) // pp
        chunks = seg if vpp > 1 else ()
        stages = _ranks(list(seg), pp)
        segments = segment_text(shape, seg)
    elif layout is not None or acc_emb or acc_loss:
        if first is not None or last is not None or (layout is not None and (acc_emb or acc_loss)):
            raise ConfigError("--explain", "layout, account and first/last are three spellings of the split: give one")
        if layout is not None:
            from ..partition import parse_pipeline_layout
            st = parse_pipeline_layout(layout, pp, "--explain layout")
            vpp = len(st) // pp
            ch = [x.count("t") for x in st]
        else:
            n = shape.num_layers + int(acc_emb) + int(acc_loss)
            if n % (pp * vpp):
                raise ConfigError("--explain", f"{n} layers with the embedding/loss slots do not divide into "
                                               f"PP x VPP = {pp} x {vpp} stages")
            ch = [n // (pp * vpp)] * (pp * vpp)
            ch[0] -= int(acc_emb)
            ch[-1] -= int(acc_loss)
        if sum(ch) != shape.num_layers or min(ch) < 0:
            raise ConfigError("--explain", f"the split places {sum(ch)} layers, the model has {shape.num_layers}")
        chunks = tuple(ch) if vpp > 1 and pp > 1 else ()
        stages = tuple(sum(ch[r::pp]) for r in range(pp))
    elif first is None and last is None:
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
    if not chunks and vpp > 1 and pp > 1 and (first is not None or last is not None):
        chunks = flag_chunks(stages, vpp)
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
    from ..knobs import FSDP_STRATEGIES
    if fsdp is not None and fsdp not in FSDP_STRATEGIES:
        raise ConfigError("--explain", f"fsdp must be one of {', '.join(FSDP_STRATEGIES)} or off, got {fsdp!r}")
    return Candidate(tp, pp, cp, vpp, first, last, sp, mbs, recompute, dist_opt or bool(fsdp), dp,
                     global_batch_size // (mbs * dp), stages, ep, etp if shape.moe else 1, shape.moe is not None,
                     fsdp=fsdp, fp8=fp8, acc_emb=acc_emb, acc_loss=acc_loss, pp_layout=layout, chunks=chunks,
                     segments=segments)


def hybrid_segments(shape: ModelShape, text: str, key: str) -> tuple[int, ...]:
    """The layers of each '|' segment of ``text``, a hybrid pattern that must be the model's own with '|' added
    (anything after '/' is the MTP depths, which the model's pattern fixes)."""
    main = str(text).split("/")[0]
    if not shape.layout.hybrid_layer_pattern:
        raise ConfigError(key, "applies to hybrid models (--hybrid-layer-pattern); this model has no pattern")
    if not hybrid_pipes(shape):
        raise ConfigError(key, "'|' segments need megatron-core 0.17 or later (0.16's MambaStack has none)")
    if main.replace("|", "") != shape.layout.hybrid_layer_pattern:
        raise ConfigError(key, f"{main!r} without its '|' must be the model's pattern "
                               f"{shape.layout.hybrid_layer_pattern!r}")
    return tuple(len(x) for x in main.split("|"))
