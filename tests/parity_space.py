"""A differential fuzz of memguard's reading of Megatron command lines against megatron-core 0.19.2's real
``megatron.training`` (tests/test_parity_megatron_019.py, Python 3.12).

``command_lines()`` draws pretrain_gpt.py command lines that mix the parallel sizes (TP, PP, VPP, CP, EP,
ETP, the world), mixture of experts, recomputation, FP8, Megatron-FSDP, CUDA graphs, activation
offloading, multi-token prediction and the pipeline split flags, loosely: many break one of Megatron's
start-up rules on purpose. ``classify()`` runs Megatron's own parser and ``validate_args`` on one of them
and memguard's three readings of it (the flags, as ``memguard estimate -- <flags>`` reads them; the
parsed namespace before validation, as the hook reads it; the validated namespace, as
``layout_from_megatron_args`` reads it), and names the outcome:

  ok-reject   Megatron rejects, memguard refuses (any MemguardError)
  ok-same     both accept and the three readings give the same numbers
  ok-refused  Megatron accepts, memguard refuses with NotModelledError (a documented refusal)
  a           Megatron rejects, memguard estimates
  b           Megatron accepts, memguard refuses with anything but NotModelledError
  c           both accept, the readings' numbers differ
  env         Megatron needs a Transformer Engine module this CPU environment lacks (not compared)
  d           a traceback (an exception that is not a MemguardError) in memguard
"""
from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from megatron_memguard.megatron.preflight import silenced

VERSION = "0.19.2"
# what pretrain_gpt.py passes as args_defaults
DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


@dataclass(frozen=True)
class Case:
    flags: tuple[str, ...]
    world: int

    @property
    def fsdp(self) -> bool:
        return "--use-megatron-fsdp" in self.flags or "--use-torch-fsdp2" in self.flags

    def __str__(self) -> str:
        return f"WORLD_SIZE={self.world} pretrain_gpt.py " + " ".join(self.flags)


def _maybe(draw, p_of_4: int = 1) -> bool:
    """True with probability p_of_4 / 4."""
    return draw(st.integers(0, 3)) < p_of_4


@st.composite
def command_lines(draw) -> Case:
    """Mostly jobs Megatron starts, each rule broken now and then (about one command line in two)."""
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2, 4]))
    cp = draw(st.sampled_from([1, 1, 1, 2]))
    experts = draw(st.sampled_from([None, None, 4, 8, 16] + ([6] if _maybe(draw, 1) else [])))
    ep = draw(st.sampled_from([1, 1, 2, 4, 8] if experts else [1]))
    etp = draw(st.sampled_from([None, None, None, 1, tp] + ([2, 4] if _maybe(draw, 1) else [])))
    world = math.lcm(tp * pp * cp, (etp or tp) * ep * pp) * draw(st.sampled_from([1, 1, 2, 4]))
    if _maybe(draw, 1) and _maybe(draw, 2):
        world = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 32, 64]))
    per_stage = draw(st.integers(1, 4))
    layers = pp * per_stage + (1 if _maybe(draw, 1) and _maybe(draw, 1) else 0)
    heads = draw(st.sampled_from([4, 8, 16]))
    kv = draw(st.sampled_from([16, 32, 64]))
    seq = draw(st.sampled_from([256, 512, 1024, 1000]))
    mbs = draw(st.sampled_from([1, 2, 4]))
    f = ["--num-layers", str(layers), "--hidden-size", str(heads * kv), "--num-attention-heads", str(heads),
         "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(draw(st.sampled_from([1000, 32000]))),
         "--position-embedding-type", "rope", "--no-rope-fusion", "--lr", "1e-4", "--train-iters", "10",
         "--mock-data", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
         "--context-parallel-size", str(cp)]
    if _maybe(draw, 2):
        # (1001 and 2: FFN widths a TP 2 / 4 split of MLP.linear_fc2 cannot divide)
        f += ["--ffn-hidden-size", str(draw(st.sampled_from([256, 1024, 1000] + ([1001, 2] if _maybe(draw, 1) else []))))]
    if _maybe(draw, 2):
        f += ["--global-batch-size", str(mbs * world * draw(st.sampled_from([1, 2, 3, 8])) // (tp * pp * cp)
                                         if _maybe(draw, 3) else mbs * draw(st.sampled_from([1, 3, 8, 32])))]
    f += draw(st.sampled_from([["--bf16"], ["--bf16"], ["--fp16"], []]))
    if _maybe(draw, 2) or (experts and (etp or tp) != 1 and _maybe(draw, 3)):
        f.append("--disable-bias-linear")
    if _maybe(draw, 2):
        f.append("--swiglu")
    if _maybe(draw, 3 if experts else 2):
        f.append("--sequence-parallel")
    if _maybe(draw, 2):
        f.append("--use-distributed-optimizer")
    if _maybe(draw, 1):
        f.append("--untie-embeddings-and-output-weights")
    if _maybe(draw, 2):
        f += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    if ep > 1:
        f += ["--expert-model-parallel-size", str(ep)]
    if etp is not None:
        f += ["--expert-tensor-parallel-size", str(etp)]

    # pipeline split: virtual stages, uneven first/last stages, or a layout string
    split = draw(st.sampled_from(["even", "even", "vpp", "uneven", "layout"]))
    if split == "vpp" and (pp > 1 or _maybe(draw, 1)):
        v = draw(st.sampled_from([v for v in (2, 3, 4) if per_stage % v == 0] or [2]) if _maybe(draw, 3)
                 else st.sampled_from([2, 4]))
        f += ["--num-virtual-stages-per-pipeline-rank", str(v)]
        if _maybe(draw, 1):
            f.append("--no-overlap-p2p-communication")
    elif split == "uneven" and pp > 1:
        # (at PP 1 Megatron takes first/last stage sizes whose sum breaks its own middle-stage rule: the
        # TransformerConfig's check passes by a sign accident, -1 middle stages; memguard refuses them)
        if _maybe(draw, 2):
            f += ["--decoder-first-pipeline-num-layers", str(draw(st.integers(0, 3)))]
        if _maybe(draw, 2):
            f += ["--decoder-last-pipeline-num-layers", str(draw(st.integers(0, 3)))]
    elif split == "layout" and pp > 1:
        stages = [["t"] * per_stage for _ in range(pp * draw(st.sampled_from([1, 1, 2])))]
        if _maybe(draw, 1) and len(stages) > 1 and per_stage > 1:    # uneven: a layer moves to the last stage
            stages[0].pop()
            stages[-1].append("t")
        stages[0].insert(0, "E")
        if _maybe(draw, 1):
            stages[-1].append("m")                                   # an MTP layer in the layout
        stages[-1].append("L")
        f += ["--pipeline-model-parallel-layout", "|".join("".join(s) for s in stages)]

    if experts:
        topk = draw(st.sampled_from([1, 2, 2, 4, 8]))
        f += ["--num-experts", str(experts), "--moe-router-topk", str(topk)]
        if topk == 1 and _maybe(draw, 3):
            f.append("--moe-router-pre-softmax")
        if _maybe(draw, 2):
            f += ["--moe-ffn-hidden-size", str(draw(st.sampled_from([128, 256, 250] + ([129] if _maybe(draw, 1) else []))))]
        freq = draw(st.sampled_from([None, None, "1", "2", "3", f"([0]*1+[1]*{layers - 1})", f"[1]*{layers}",
                                     f"([1]*{layers + 1})"]))
        if freq is not None:
            f += ["--moe-layer-freq", freq]
        if _maybe(draw, 1):
            f += ["--moe-shared-expert-intermediate-size", str(draw(st.sampled_from([128, 256, 130])))]
            if _maybe(draw, 1):
                f.append("--moe-shared-expert-overlap")
        disp = draw(st.sampled_from(["allgather", "alltoall", "alltoall", "flex"]))
        f += ["--moe-token-dispatcher-type", disp]
        if disp == "flex":
            f += ["--moe-flex-dispatcher-backend", draw(st.sampled_from(["deepep", "deepep", "hybridep"]))]
        if _maybe(draw, 2):
            f.append("--moe-grouped-gemm")
        if _maybe(draw, 1):
            f.append("--moe-permute-fusion")
        if _maybe(draw, 1):
            f += ["--moe-expert-capacity-factor", str(draw(st.sampled_from([1.0, 2.0])))]
            if _maybe(draw, 2):
                f.append("--moe-pad-expert-input-to-capacity")
        if _maybe(draw, 1):
            f += ["--moe-router-dtype", draw(st.sampled_from(["fp32", "fp64"]))]
        if _maybe(draw, 1):
            f += ["--moe-router-load-balancing-type", draw(st.sampled_from(["aux_loss", "none", "seq_aux_loss"]))]
        if _maybe(draw, 1):
            f.append("--overlap-moe-expert-parallel-comm")
            if _maybe(draw, 2):
                f.append("--delay-wgrad-compute")

    rec = draw(st.sampled_from(["none", "none", "selective", "full", "activations"]))
    if rec == "selective":
        f += ["--recompute-granularity", "selective"]
        if _maybe(draw, 3):
            pool = ["core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts"]
            f += ["--recompute-modules", *draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))]
    elif rec == "full":
        f += ["--recompute-granularity", "full", "--recompute-method", draw(st.sampled_from(["uniform", "block"])),
              "--recompute-num-layers", str(draw(st.integers(0, 2)))]
    elif rec == "activations":
        f.append("--recompute-activations")

    if _maybe(draw, 1):
        f += ["--fp8-format", draw(st.sampled_from(["e4m3", "hybrid"])),
              "--fp8-recipe", draw(st.sampled_from(["delayed", "tensorwise", "blockwise", "mxfp8"]))]
        if _maybe(draw, 1):
            f.append("--fp8-param-gather")
    if _maybe(draw, 1):
        f += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
              draw(st.sampled_from(["no_shard", "optim", "optim_grads", "optim_grads_params"])),
              "--ckpt-format", draw(st.sampled_from(["fsdp_dtensor", "fsdp_dtensor", "fsdp_dtensor", "torch_dist"]))]
    cg = draw(st.sampled_from(["none", "none", "none", "impl", "enable", "external"]))
    if cg == "impl":
        f += ["--cuda-graph-impl", draw(st.sampled_from(["local", "transformer_engine"]))]
        if _maybe(draw, 2):
            mods = draw(st.lists(st.sampled_from(["attn", "mlp", "moe", "moe_router", "moe_preprocess"]),
                                 min_size=1, max_size=2, unique=True))
            f += [draw(st.sampled_from(["--cuda-graph-modules", "--cuda-graph-scope"])), *mods]
    elif cg == "enable":
        f.append("--enable-cuda-graph")
    elif cg == "external":
        f.append("--external-cuda-graph")
    if _maybe(draw, 1):
        f.append("--fine-grained-activation-offloading")
        if _maybe(draw, 3):
            pool = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
            f += ["--offload-modules", *draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))]
    if _maybe(draw, 1):
        f += ["--mtp-num-layers", str(draw(st.integers(1, 2)))]
    # a few more settings validate_args rewrites or derives from
    extras = [["--num-layers-per-virtual-pipeline-stage", "1"], ["--account-for-embedding-in-pipeline-split"],
              ["--account-for-loss-in-pipeline-split"], ["--group-query-attention", "--num-query-groups", "2"],
              ["--num-distributed-optimizer-instances", "2"], ["--microbatch-group-size-per-virtual-pipeline-stage", "4"],
              ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"], ["--cpu-offloading-num-layers", "1"],
              ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"], ["--moe-layer-recompute"],
              ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"], ["--overlap-grad-reduce", "--overlap-param-gather"],
              ["--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "32",
               "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32"], ["--recompute-modules", "mla_up_proj"],
              ["--qk-layernorm"], ["--fp8-param-gather"], ["--ckpt-format", "torch"],
              ["--group-query-attention", "--num-query-groups", "1", "--kv-channels", "33"]]
    if experts:
        extras += [["--moe-shared-expert-gate"], ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
                   ["--moe-aux-loss-coeff", "1e-2"], ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                                                      "--moe-aux-loss-coeff", "1e-2", "1e-3"],
                   ["--moe-z-loss-coeff", "1e-3"], ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
                   ["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
                   ["--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate"],
                   ["--moe-router-score-function", "sqrtsoftplus"], ["--moe-router-enable-expert-bias"],
                   ["--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias"],
                   ["--moe-router-load-balancing-type", "quantile_balancing"], ["--moe-input-jitter-eps", "0.01"],
                   ["--moe-router-force-biased", "0.5"],
                   ["--moe-shared-expert-intermediate-size", "128", "--use-grouped-gemm-for-shared-expert",
                    "--moe-shared-expert-glu-interleave-size", "32", "--swiglu"]]
    for extra in draw(st.lists(st.sampled_from(extras), max_size=2, unique_by=tuple)):
        f += extra
    return Case(tuple(f), world)


@st.composite
def split_shapes(draw) -> Case:
    """Jobs that break no other rule but now and then one of the model build's ``divide()`` asserts: the FFN,
    expert FFN, shared-expert and QKV widths over TP / ETP, and group-limited routing's groups (command_lines()
    reaches them rarely: another rule usually rejects its job first)."""
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = draw(st.sampled_from([4, 8, 16]))
    base = list(BASE)
    base[base.index("--num-attention-heads") + 1] = str(heads)
    f = [*base, "--kv-channels", str(draw(st.sampled_from([32, 33, 64]))),
         "--ffn-hidden-size", str(draw(st.sampled_from([1024, 1001, 1002, 2]))), "--disable-bias-linear",
         "--tensor-model-parallel-size", str(tp)]
    groups = draw(st.sampled_from([None, 1, 2, 4]))
    if groups:
        f += ["--group-query-attention", "--num-query-groups", str(groups)]
    if tp > 1:
        f.append("--sequence-parallel")
    etp, ep = tp, 1
    if _maybe(draw, 2):
        ep, etp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, tp]))
        topk = draw(st.sampled_from([2, 4]))
        f += ["--num-experts", "8", "--moe-router-topk", str(topk), "--moe-token-dispatcher-type", "alltoall",
              "--moe-grouped-gemm", "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
              "--moe-ffn-hidden-size", str(draw(st.sampled_from([256, 129, 130]))),
              "--moe-layer-freq", draw(st.sampled_from(["1", "2"]))]
        if _maybe(draw, 1):
            f += ["--moe-shared-expert-intermediate-size", str(draw(st.sampled_from([128, 129, 130])))]
        route = draw(st.sampled_from([None, (2, 1), (4, 1), (8, 1), (4, 2)]))
        if route:
            f += ["--moe-router-num-groups", str(route[0]), "--moe-router-group-topk", str(route[1])]
    return Case(tuple(f), math.lcm(tp, etp * ep))


# ---------------------------------------------------------------------------------------------------
# Megatron's side: its own parser and validate_args, in-process (no global state is set: neither
# parse_args's sys.argv nor set_global_variables is used)

_PARSER: argparse.ArgumentParser | None = None


def megatron_parser() -> argparse.ArgumentParser:
    global _PARSER
    if _PARSER is None:
        import inspect
        from megatron.training.arguments import add_megatron_arguments
        # (Megatron's own: the hook, when installed by another test, adds its --memguard flags)
        _PARSER = inspect.unwrap(add_megatron_arguments)(argparse.ArgumentParser(allow_abbrev=False))
    return _PARSER




# Transformer Engine is not installed with the CPU wheels: the TransformerConfig's version checks are
# answered as TE 2.11 would answer them; a check that imports TE is the environment, not a rule
TE_VERSION = "2.11.0"
_TE_MISSING = ("install TE", "transformer-engine>=", "transformer_engine", "Transformer Engine")


def pretend_te() -> None:
    """Answer Transformer Engine's version checks as TE 2.11 would, and give the TransformerConfig's
    availability check of TE's fused permutation kernels something that is not None (moe_utils binds them
    to None when TE is missing; nothing here runs them)."""
    from megatron.core import utils
    from megatron.core.transformer.moe import moe_utils
    from packaging.version import Version
    utils._te_version = Version(TE_VERSION)
    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        if getattr(moe_utils, name, None) is None:
            setattr(moe_utils, name, object())


def megatron_reads(case: Case) -> tuple[Any, Any, str | None]:
    """(namespace before validate_args, after it, Megatron's rejection or None). The caller sets the
    environment (tests/test_parity_megatron_019.py: WORLD_SIZE, CUDA_DEVICE_MAX_CONNECTIONS, an H100)."""
    import inspect
    from megatron.training.arguments import validate_args
    validate_args = inspect.unwrap(validate_args)   # Megatron's own, not memguard's hook around it
    try:
        with silenced():
            ns = megatron_parser().parse_args(list(case.flags))
    except SystemExit:
        return None, None, "argparse rejects the command line"
    # what parse_args adds (megatron/training/arguments.py, 0.19.2)
    ns._is_global_batch_size_explicitly_specified = ns.global_batch_size is not None
    ns.rank, ns.world_size = 0, case.world
    before = copy.deepcopy(ns)
    try:
        with silenced():
            validate_args(ns, dict(DEFAULTS))
    except (Exception, SystemExit) as e:   # noqa: BLE001 (Megatron asserts, raises ValueError or exits)
        return before, None, "validate_args: " + _said(e)
    # the model's TransformerConfig, as pretrain_gpt.py builds it next (its __post_init__ checks)
    from megatron.training.argument_utils import gpt_config_from_args
    try:
        with silenced():
            config = gpt_config_from_args(copy.deepcopy(ns)).transformer
    except Exception as e:   # noqa: BLE001
        return before, None, "TransformerConfig: " + _said(e)
    # the optimizer and DDP configs setup_model_and_optimizer builds (their __post_init__ checks)
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config
    try:
        with silenced():
            get_megatron_optimizer_config(copy.deepcopy(ns))
            get_megatron_ddp_config(copy.deepcopy(ns))
    except Exception as e:   # noqa: BLE001
        return before, None, "optimizer / DDP config: " + _said(e)
    try:
        with silenced():
            later = _later_rules(ns, config)
    except Exception as e:   # noqa: BLE001
        return before, None, "model build: " + _said(e)
    if later:
        return before, None, later
    return before, ns, None


def _said(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200]


def _later_rules(ns: Any, config: Any) -> str | None:
    """The start-up rules Megatron checks after the TransformerConfig, before the first step: run where
    they run without a GPU or process group, written out (with their source, 0.19.2) where they do not."""
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    # set_global_variables -> init_num_microbatches_calculator (num_microbatches_calculator.py)
    dp = ns.data_parallel_size * ns.gtp_weight_remat_size
    m = ConstantNumMicroBatchesCalculator(ns.global_batch_size, ns.micro_batch_size, dp, False, 0)
    num_microbatches = m.get()
    # the model build: every (pipeline rank, virtual stage) builds its layers (transformer_block.py)
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    # (a --pipeline-model-parallel-layout is checked whole by the TransformerConfig)
    if config.pipeline_model_parallel_layout is None:
        built = [get_num_layers_to_build(config, vp_stage=vp if vpp else None, pp_rank=rank)
                 for rank in range(pp) for vp in range(vpp or 1)]
        # uneven first/last stages that leave a negative number of layers for the others: Megatron builds
        # range(n) layers per stage, a model with other than --num-layers layers (no rule stops it)
        if min(built) < 0 or sum(built) != config.num_layers:
            return f"model build: the stages build {built} layers, not --num-layers {config.num_layers}"
        # each layer's index offset (transformer_layer.py get_transformer_layer_offset) divides by the middle
        # stages under VPP even when first/last leave none
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        try:
            for rank in range(pp):
                for vp in range(vpp or 1):
                    get_transformer_layer_offset(config, vp_stage=vp if vpp else None, pp_rank=rank)
        except ZeroDivisionError:
            return "model build: the interleaved layer offset divides by zero middle stages"
    # get_gpt_decoder_block_spec: one --moe-layer-freq entry per layer (models/gpt/gpt_layer_specs.py 653)
    if ns.num_experts and isinstance(ns.moe_layer_freq, list) and len(ns.moe_layer_freq) != ns.num_layers:
        return f"gpt_layer_specs: {len(ns.moe_layer_freq)} --moe-layer-freq entries for {ns.num_layers} layers"
    # the router's torch.topk over the experts fails at the first forward when k > experts
    # (moe/moe_utils.py topk_routing_with_score_function)
    if ns.num_experts and ns.moe_router_topk > ns.num_experts:
        return f"router: torch.topk of {ns.moe_router_topk} among {ns.num_experts} experts"
    # SharedExpertMLP.__init__: no bias in shared experts (moe/shared_experts.py 124)
    if ns.num_experts and ns.moe_shared_expert_intermediate_size and ns.add_bias_linear:
        return "SharedExpertMLP: bias is not supported in the shared experts"
    # TE's DotProductAttention at the first forward: flash-attn and cuDNN take only bf16/fp16 q/k/v, and its unfused
    # attention does not run under context parallelism (get_attention_backend's dtype and context-parallelism
    # filters, transformer_engine/pytorch/attention/dot_product_attention/utils.py, TE 2.11.0 and 2.20.2)
    if (ns.transformer_impl == "transformer_engine" and ns.context_parallel_size > 1
            and not (ns.bf16 or ns.fp16)):
        return "TE attention: no backend for fp32 q/k/v under context parallelism"
    split = _tp_split(config)
    if split:
        return split
    # Router.quantile_balancing and qb_dual_update assert at the first forward (moe/router.py 325-329,
    # moe/moe_utils.py 230): no router fusion, no group-limited routing, s x b x top-k divisible by the experts
    if ns.num_experts and config.moe_router_load_balancing_type == "quantile_balancing":
        if config.moe_router_fusion:
            return "quantile_balancing: does not support moe_router_fusion"
        if config.moe_router_num_groups is not None or config.moe_router_group_topk is not None:
            return "quantile_balancing: does not support group-limited routing"
        if (ns.seq_length * ns.micro_batch_size * config.moe_router_topk) % config.num_moe_experts:
            return "qb_dual_update: tokens x top-k not divisible by the experts"
    # FusedSharedExpertMLP (moe/shared_experts.py 389-440): at the build (TE, SwiGLU, interleave size) and at the
    # first forward (an MXFP8 or NVFP4 recipe)
    if ns.num_experts and ns.moe_shared_expert_intermediate_size and config.use_grouped_gemm_for_shared_expert:
        import torch.nn.functional as F
        if config.transformer_impl != "transformer_engine":
            return "FusedSharedExpertMLP: needs Transformer Engine"
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            return "FusedSharedExpertMLP: needs SwiGLU"
        if config.moe_shared_expert_glu_interleave_size is None:
            return "FusedSharedExpertMLP: needs moe_shared_expert_glu_interleave_size"
        if not ((config.fp8 and str(getattr(config.fp8_recipe, "value", config.fp8_recipe)) == "mxfp8")
                or (config.fp4 and str(getattr(config.fp4_recipe, "value", config.fp4_recipe)) == "nvfp4")):
            return "FusedSharedExpertMLP: needs fp8_recipe mxfp8 or fp4_recipe nvfp4"
    # group_limited_topk: each group's top (topk // group_topk) scores (moe/moe_utils.py 656): torch.topk
    # over a group of fewer experts fails at the first forward
    n, groups, gtopk = config.num_moe_experts, config.moe_router_num_groups, config.moe_router_group_topk
    if n and groups and gtopk and config.moe_router_topk // gtopk > n // groups:
        return f"group_limited_topk: torch.topk of {config.moe_router_topk // gtopk} among {n // groups} experts per group"
    # checkpointed_forward: the uniform loop advances by recompute_num_layers, 0 never ends (recompute.py 157)
    if config.recompute_granularity == "full" and config.recompute_method == "uniform" and not config.recompute_num_layers:
        return "checkpointed_forward: uniform recompute of 0 layers never finishes a forward"
    # MultiTokenPredictionLayer._checkpointed_forward asserts one layer per checkpoint under uniform at the first
    # forward (transformer/multi_token_prediction.py 1420, 0.19.2)
    if (config.mtp_num_layers and config.recompute_granularity == "full" and config.recompute_method == "uniform"
            and config.recompute_num_layers != 1):
        return "MultiTokenPredictionLayer: recompute_num_layers must be 1 for MTP recompute"
    # initialize_model_parallel: the expert grid (parallel_state.py 881)
    expert_grid = ns.expert_tensor_parallel_size * ns.expert_model_parallel_size * pp * ns.expert_gtp_weight_remat_size
    if ns.world_size % expert_grid:
        return f"parallel_state: world_size {ns.world_size} is not divisible by ETP x EP x PP = {expert_grid}"
    # initialize_model_parallel: the optimizer instances divide the (expert) data-parallel groups
    # (parallel_state.py 924 and 1448)
    instances = ns.num_distributed_optimizer_instances
    if (ns.data_parallel_size * ns.context_parallel_size) % instances or (ns.world_size // expert_grid) % instances:
        return f"parallel_state: {instances} optimizer instances do not divide the (expert) data-parallel size"
    # DistributedDataParallel.__init__: "Partial DistOpt cannot be used without DistOpt"
    # (distributed/distributed_data_parallel.py 292; Megatron-FSDP has its own class)
    if instances > 1 and not ns.use_distributed_optimizer and not ns.use_megatron_fsdp:
        return "DistributedDataParallel: several optimizer instances need the distributed optimizer"
    # HybridDeviceOptimizer._get_sub_optimizer_param_groups (optimizer/cpu_offloading/hybrid_optimizer.py 274) pins a
    # host clone of each offloaded parameter; under FSDP they are DTensors, which torch cannot pin (NYI
    # aten._pin_memory, tests/test_fsdp_estimate.py)
    if (ns.optimizer_cpu_offload and (ns.use_megatron_fsdp or ns.use_torch_fsdp2)
            and ns.optimizer_offload_fraction > 0):
        return "HybridDeviceOptimizer: FSDP's DTensor parameters cannot be pinned"
    # the Megatron-FSDP adapter's asserts on the expert all-to-all overlap (distributed/fsdp/mcore_fsdp_adapter.py)
    if ns.use_megatron_fsdp and ns.num_experts and ns.overlap_moe_expert_parallel_comm:
        if ns.fsdp_double_buffer:
            return "FullyShardedDataParallel: 1F1B overlap with FSDP does not support double buffer"
        if str(ns.cuda_graph_impl) not in ("none", "full_iteration"):
            return "FullyShardedDataParallel: 1F1B overlap with FSDP does not support per-layer CUDA graphs"
    # MoELayer.forward: MoE with TP > 1 in training needs sequence parallelism (moe/moe_layer.py 629)
    if ns.num_experts and ns.tensor_model_parallel_size > 1 and not ns.sequence_parallel:
        return "MoELayer.forward: MoE with tensor parallelism needs sequence parallelism"
    # the interleaved schedule (pipeline_parallel/schedules.py 1133-1153)
    if vpp is not None and pp > 1:
        g = config.microbatch_group_size_per_vp_stage
        if g > num_microbatches or g < pp:
            return f"schedules: micro-batch group {g} outside [PP={pp}, M={num_microbatches}]"
        if 0 < num_microbatches % g < pp:
            return f"schedules: a last micro-batch group of {num_microbatches % g} < PP={pp}"
    return None


def _tp_split(config: Any) -> str | None:
    """The model build's ``divide()`` asserts (megatron/core/utils.py 561) on the linear layers split over TP or
    ETP, 0.19.2: ColumnParallelLinear / RowParallelLinear (tensor_parallel/layers.py 965, 1328), Transformer
    Engine's column / row linears (TE's own divide of out_features / in_features by tp_size; Megatron's
    wrappers extensions/transformer_engine.py 1292, 1451, 1707; the experts' TELinear 1010-1012 and
    TEGroupedLinear 2193-2195)."""
    tp, etp = config.tensor_model_parallel_size, config.expert_tensor_parallel_size
    # the dense / MoE layer pattern, as get_gpt_decoder_block_spec reads --moe-layer-freq (gpt_layer_specs.py 647)
    freq = config.moe_layer_freq
    if not config.num_moe_experts:
        pattern = [0] * config.num_layers
    elif isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    # MLP.linear_fc2: a row-parallel linear over the FFN width (transformer/mlp.py)
    if 0 in pattern and config.ffn_hidden_size % tp:
        return f"MLP linear_fc2: divide({config.ffn_hidden_size}, TP {tp})"
    if config.num_moe_experts:
        # the experts' fc2 over ETP (moe/experts.py: TEGroupedMLP, SequentialMLP)
        if config.moe_ffn_hidden_size % etp:
            return f"experts linear_fc2: divide({config.moe_ffn_hidden_size}, ETP {etp})"
        # SharedExpertMLP: an MLP of the shared width over TP (moe/shared_experts.py 124)
        shared = config.moe_shared_expert_intermediate_size
        if shared and shared % tp:
            return f"SharedExpertMLP linear_fc2: divide({shared}, TP {tp})"
    if not config.multi_latent_attention:
        # SelfAttention.linear_qkv's columns (transformer/attention.py 1678)
        out = config.kv_channels * (config.num_attention_heads * (2 if config.attention_output_gate else 1)
                                    + 2 * config.num_query_groups)
        if out % tp:
            return f"SelfAttention linear_qkv: divide({out}, TP {tp})"
    return None


# ---------------------------------------------------------------------------------------------------
# memguard's side: three readings of the same job

def _numbers(layout) -> Any:
    from megatron_memguard import estimate, lookup_gpu
    # (MXFP8 and NVFP4 need a Blackwell GPU: memguard refuses it on an H100, as Transformer Engine does)
    blackwell = layout.fp8_recipe == "mxfp8" or layout.fp4_recipe == "nvfp4"
    est = estimate(layout, gpu=lookup_gpu("B200" if blackwell else "H100-80GB"))
    return [s.to_dict() for s in est.stages]


def memguard_reads(case: Case, before: Any, after: Any) -> dict[str, Any]:
    """Each reading's numbers, or the exception it raised."""
    from megatron_memguard import layout_from_flags, layout_from_megatron_args
    from megatron_memguard.megatron.preflight import raw_config_from_args
    from megatron_memguard.resolve import resolve
    readings: dict[str, Any] = {}
    steps = {"flags": lambda: layout_from_flags(list(case.flags), world_size=case.world, megatron_version=VERSION)}
    if before is not None:
        steps["hook"] = lambda: resolve(raw_config_from_args(before, DEFAULTS), world_size=case.world,
                                        megatron_version=VERSION)
    if after is not None:
        steps["validated"] = lambda: layout_from_megatron_args(after, world_size=case.world, megatron_version=VERSION)
    for name, step in steps.items():
        try:
            with silenced():
                readings[name] = _numbers(step())
        except Exception as e:  # noqa: BLE001 (classified below)
            readings[name] = e
    return readings


def classify(case: Case) -> tuple[str, str]:
    """(class, what happened): see the module's docstring."""
    from megatron_memguard.errors import MemguardError, NotModelledError
    before, after, rejected = megatron_reads(case)
    if rejected and any(t in rejected for t in _TE_MISSING):
        return "env", rejected
    readings = memguard_reads(case, before, after)
    for name, r in readings.items():
        if isinstance(r, Exception) and not isinstance(r, MemguardError):
            return "d", f"{name}: {type(r).__name__}: {r}"
    if rejected:
        est = [n for n, r in readings.items() if not isinstance(r, Exception) and n == "flags"]
        return ("a", f"Megatron: {rejected}; memguard estimates ({', '.join(est)})") if est else \
            ("ok-reject", rejected)
    errs = {n: r for n, r in readings.items() if isinstance(r, Exception)}
    bad = {n: r for n, r in errs.items() if not isinstance(r, NotModelledError)}
    if bad:
        return "b", "; ".join(f"{n}: {type(r).__name__}: {r}" for n, r in bad.items())
    if errs:
        if len(errs) != len(readings):
            return "c", "; ".join(f"{n} refuses: {r}" for n, r in errs.items()) + \
                f" (the others estimate: {sorted(set(readings) - set(errs))})"
        return "ok-refused", str(next(iter(errs.values())))
    first = readings["flags"]
    diff = [n for n, r in readings.items() if r != first]
    if diff:
        return "c", f"{', '.join(diff)} differ from the flags: {_first_difference(first, readings[diff[0]])}"
    return "ok-same", ""


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                name = x.get("name", i) if isinstance(x, dict) else i
                return _first_difference(x, y, f"{path}[{name}]")
    return f"{path}: {str(a)[:120]} != {str(b)[:120]}"


# ---------------------------------------------------------------------------------------------------
# What the fuzz found: one command line per rule memguard lacked, the flag its refusal names, the eras
# whose Megatron has the rule, and where Megatron checks it (0.19.2 unless said). tests/test_parity_rules.py
# checks memguard refuses them (both eras); tests/test_parity_megatron_019.py that Megatron 0.19.2 does too.

BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --position-embedding-type rope "
        "--no-rope-fusion --lr 1e-4 --train-iters 10 --mock-data --bf16").split()
MOE = ("--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
       "--disable-bias-linear").split()


@dataclass(frozen=True)
class Found:
    flags: tuple[str, ...]
    world: int
    key: str                 # the flag memguard's one-line error names
    eras: tuple[str, ...]    # the Megatron versions with the rule
    source: str              # where Megatron checks it
    newer: bool = False      # the option came after 0.16: the older eras refuse it naming the release

    def case(self) -> Case:
        return Case(tuple(BASE) + self.flags, self.world)


FOUND = [
    Found(("--num-virtual-stages-per-pipeline-rank", "2"), 2, "--pipeline-model-parallel-size", ("0.16", "0.19"),
          "validate_args, megatron/training/arguments.py lines 966-975: the interleaved schedule needs PP > 1"),
    Found(("--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "8"), 4,
          "--expert-tensor-parallel-size", ("0.16", "0.19"),
          "TransformerConfig.__post_init__, transformer_config.py line 2279 (0.16.1: 1588): experts with biases need "
          "ETP 1 (ETP defaults to TP)"),
    Found(("--expert-tensor-parallel-size", "4"), 2, "--expert-tensor-parallel-size", ("0.16", "0.19"),
          "initialize_model_parallel, megatron/core/parallel_state.py line 881 (0.16.1: 792): the world divides into "
          "ETP x EP x PP, dense models too"),
    Found(("--recompute-granularity", "selective", "--recompute-modules", "moe_act"), 2, "--recompute-modules",
          ("0.16", "0.19"), "TransformerConfig.__post_init__, transformer_config.py line 1784 (0.16.1: 1213): moe_act "
          "recompute needs --moe-grouped-gemm, dense models too"),
    Found(("--recompute-granularity", "selective", "--external-cuda-graph"), 2, "--attention-dropout", ("0.16", "0.19"),
          "TransformerConfig.__post_init__, transformer_config.py line 2545 (0.16.1: 1805): no attention dropout in a "
          "graphed core_attn recompute"),
    Found(("--attention-dropout", "0", "--recompute-granularity", "selective", "--recompute-modules", "mlp",
           "--enable-cuda-graph"), 2, "--hidden-dropout", ("0.16", "0.19"),
          "TransformerConfig.__post_init__, transformer_config.py line 2553 (0.16.1: 1812): no hidden dropout in a "
          "graphed mlp / moe recompute"),
    Found((*MOE, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "mlp"), 2, "--cuda-graph-modules",
          ("0.16", "0.19"), "TransformerConfig.__post_init__, transformer_config.py line 2501 (0.16.1: 1760): the mlp "
          "graph needs a dense layer"),
    Found((*MOE, "--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"), 2, "--cuda-graph-modules",
          ("0.16", "0.19"), "TransformerConfig.__post_init__, transformer_config.py line 2511 (0.16.1: 1770): the moe "
          "graph needs drop-and-pad routing"),
    Found(("--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "--fine-grained-activation-offloading",
           "--offload-modules", "qkv_linear"), 2, "--offload-modules", ("0.19",),
          "TransformerConfig.__post_init__, transformer_config.py line 2601: local CUDA graphs let only expert_fc1, "
          "moe_act and fused_group_mlp be offloaded"),
    Found(("--cuda-graph-impl", "local", "--fine-grained-activation-offloading", "--offload-modules", "expert_fc1"), 2,
          "--cuda-graph-impl", ("0.19",), "TransformerConfig.__post_init__, transformer_config.py line 2607: no "
          "offloading under local whole-layer CUDA graphs"),
    Found((*MOE, "--recompute-granularity", "selective", "--recompute-modules", "moe",
           "--fine-grained-activation-offloading", "--offload-modules", "expert_fc1"), 2, "--offload-modules", ("0.19",),
          "TransformerConfig.__post_init__, transformer_config.py line 1874: nothing offloaded inside a MoE layer "
          "that 'moe' recompute recomputes"),
    # the model build's divide() asserts (megatron/core/utils.py 561; 0.16.1 the same rules)
    Found(("--tensor-model-parallel-size", "2", "--ffn-hidden-size", "1"), 2, "--ffn-hidden-size", ("0.16", "0.19"),
          "MLP.__init__ -> RowParallelLinear, tensor_parallel/layers.py line 1328 (0.16.1: 1166): linear_fc2 splits "
          "the FFN width over TP"),
    Found((*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-ffn-hidden-size", "129"), 2,
          "--moe-ffn-hidden-size", ("0.16", "0.19"),
          "TEGroupedMLP.__init__ -> TERowParallelGroupedLinear, extensions/transformer_engine.py line 2195 (0.16.1: "
          "1527): the experts' linear_fc2 splits the expert FFN width over ETP (= TP here)"),
    Found((*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-shared-expert-intermediate-size",
           "129"), 2, "--moe-shared-expert-intermediate-size", ("0.16", "0.19"),
          "SharedExpertMLP.__init__ (moe/shared_experts.py line 124) -> MLP: the shared experts' linear_fc2 splits "
          "their width over TP"),
    Found(("--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "1",
           "--kv-channels", "33"), 4, "--kv-channels", ("0.16", "0.19"),
          "SelfAttention.__init__, transformer/attention.py line 1678 (0.16.1: 1264): linear_qkv's 33 x (8 + 2) "
          "columns split over TP 4"),
    Found((*MOE, "--moe-router-num-groups", "8", "--moe-router-group-topk", "1"), 2, "--moe-router-group-topk",
          ("0.16", "0.19"), "group_limited_topk, transformer/moe/moe_utils.py line 656 (0.16.1: 554): torch.topk of "
          "topk // group_topk = 2 scores in a group of 1 expert fails at the first forward"),
    Found((*MOE, "--moe-input-jitter-eps", "0.01", "--hidden-dropout", "0", "--recompute-granularity", "selective",
           "--recompute-modules", "moe", "--cuda-graph-impl", "local"), 2, "--moe-input-jitter-eps", ("0.16", "0.19"),
          "TransformerConfig.__post_init__, transformer_config.py line 2567 (0.16.1: 1820): no input jitter in a "
          "graphed moe recompute"),
    # the router variants and the fused shared expert memguard models since they are no longer refused
    Found((*MOE, "--moe-router-enable-expert-bias"), 2, "--moe-router-enable-expert-bias", ("0.16", "0.19"),
          "TransformerConfig.__post_init__, transformer_config.py line 2284 (0.16.1: 1593): aux-loss-free expert bias "
          "needs the sigmoid (0.19: or sqrtsoftplus) score function"),
    Found((*MOE, "--moe-router-load-balancing-type", "quantile_balancing", "--moe-router-fusion"), 2,
          "--moe-router-fusion", ("0.19",), "Router.quantile_balancing, transformer/moe/router.py line 325: no router "
          "fusion (asserted at the first forward)", newer=True),
    Found((*MOE, "--moe-router-load-balancing-type", "quantile_balancing", "--moe-router-num-groups", "2",
           "--moe-router-group-topk", "1"), 2, "--moe-router-num-groups", ("0.19",),
          "Router.quantile_balancing, transformer/moe/router.py line 328: no group-limited routing", newer=True),
    Found((*MOE, "--moe-router-load-balancing-type", "quantile_balancing", "--seq-length", "508", "--moe-router-topk",
           "1", "--moe-router-pre-softmax"), 2, "--moe-router-topk", ("0.19",),
          "qb_dual_update, transformer/moe/moe_utils.py line 230: s x b x top-k = 508 must divide over the 8 experts",
          newer=True),
    Found((*MOE, "--moe-shared-expert-intermediate-size", "128", "--use-grouped-gemm-for-shared-expert",
           "--moe-shared-expert-glu-interleave-size", "32", "--swiglu"), 2, "--use-grouped-gemm-for-shared-expert",
          ("0.19",), "FusedSharedExpertMLP._get_fused_grouped_swiglu_recipe, transformer/moe/shared_experts.py line "
          "430: the fused kernel runs under MXFP8 or NVFP4 only", newer=True),
    # router padding for quantization, modelled since it is no longer refused
    Found((*MOE, "--moe-router-padding-for-quantization"), 2, "--moe-router-padding-for-quantization",
          ("0.16", "0.19"), "TransformerConfig.__post_init__, transformer_config.py line 2317 (0.16.1: 1622): the "
          "routing map is padded for FP8 / FP4 only (fp8/fp4 must be specified)"),
    Found(("--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
           "--recompute-num-layers", "2"), 2, "--recompute-num-layers", ("0.16", "0.19"),
          "MultiTokenPredictionLayer._checkpointed_forward, transformer/multi_token_prediction.py line 1420 (0.16.1: "
          "847): one layer per checkpoint of an MTP depth under uniform (asserted at the first forward)"),
    # found by running the bundled examples/llama3_8b_h100.sh through the real validate_args (the fuzz draws no --save)
    Found(("--save", "/checkpoints/run"), 1, "--save-interval", ("0.19",),
          "validate_args, megatron/training/arguments.py line 1322 (0.17.1: 1129): --save needs --save-interval "
          "(0.16.1's wheel has no megatron.training to read: left alone there)"),
]
