"""Section: multi-token prediction (``--mtp-num-layers``) with validate_args's rules."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..partition import parse_pipeline_layout
from .args import Args, Context


def mtp(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    hybrid_mtp = kw.get("hybrid_mtp_pattern")
    # a hybrid pattern's '/' parts are its MTP depths (resolve/hybrid.py); validate_args takes their count
    depth = kw["mtp_num_layers"] if hybrid_mtp else (a.int_arg("mtp_num_layers", 0, minimum=0) or 0)
    if depth and kw.get("hybrid_layer_pattern") and not hybrid_mtp and ctx.version >= Version("0.17"):
        # validate_args (0.17.1 to 0.19.2) only warns "Hybrid model with --mtp-num-layers but no MTP pattern";
        # HybridModel (MambaModel in 0.17) builds MTP layers from the pattern's '/' parts only (mtp_process)
        a.notes.append(f"{a.key('mtp_num_layers')}: no MTP layers are built: the hybrid pattern has no MTP "
                       "pattern after '/' (Megatron warns and trains without MTP)")
        return dict(mtp_num_layers=0)
    layout = kw.get("pipeline_model_parallel_layout")
    if layout is not None and not kw.get("hybrid_layer_pattern"):
        # (a hybrid pattern's '|' segments are written as a layout of plain layers: its MTP block is on the last
        # stage, HybridModel's mtp_on_this_rank without a layout)
        # the layout's 'm' entries place the MTP layers (partition.parse_pipeline_layout checks Megatron's rules on
        # them); PipelineParallelLayerLayout.validate_layer_layout: their count is --mtp-num-layers
        placed = sum(st.count("m") for st in parse_pipeline_layout(str(layout), kw["pipeline_model_parallel_size"],
                                                                    a.key("pipeline_model_parallel_layout")))
        if placed != depth:
            a.fail("pipeline_model_parallel_layout", f"places {placed} MTP layers ('m') but --mtp-num-layers is {depth}")
    if not depth:
        return dict(mtp_num_layers=0)
    _full_recompute(a, kw, depth, ctx)
    position = kw["position_embedding_type"]
    # validate_args (core 0.19.2, and already 0.17.1 and 0.18.2) asserts rope or none first; the reference reads
    # 0.16.1 as also taking learned_absolute and mrope (docs/assumptions.md)
    allowed = ("rope", "none") if ctx.version >= Version("0.17") else ("learned_absolute", "rope", "mrope", "none")
    if position not in allowed:
        # (the depths of a hybrid pattern's '/' parts: the error names the pattern's flag)
        named = ("mtp_num_layers" if not hybrid_mtp or a.given("mtp_num_layers") else
                 "hybrid_layer_pattern" if a.given("hybrid_layer_pattern") else "hybrid_override_pattern")
        a.fail(named, f"needs --position-embedding-type {' or '.join(allowed)} (validate_args), "
               f"got {position}")
    dest = "mtp_hybrid_override_pattern"
    if a.given(dest) and a.get(dest) not in (None, "", False, "false", "False", 0) and not hybrid_mtp:
        # validate_args (0.17.1 to 0.19.2) warns that a GPT model ignores it ("for Mamba/hybrid models only")
        a.notes.append(f"{a.key(dest)}: ignored (one MTP depth's hybrid pattern: read with a hybrid pattern and "
                       "--mtp-num-layers > 0 only)")
    if a.bool_arg("mtp_standalone", False) and layout is None:
        # TransformerConfig.__post_init__ (core 0.16.1 to 0.19.2) sets mtp_standalone from the layout when one is
        # given; without one the MTP block stays on the last stage (mtp_on_this_rank) and the flag only makes the
        # P2P calls exchange tensor shapes first (p2p_communication.py): a few int64 values
        a.notes.append(f"{a.key('mtp_standalone')}: the MTP layers stay on the last pipeline stage (only "
                       "--pipeline-model-parallel-layout moves them); the flag only makes P2P exchange shapes")
    # the repeated layer and the builder's MoE rule only when they apply: the section's output for other runs
    # stays what it was
    return dict(mtp_num_layers=depth, **({"mtp_use_repeated_layer": True} if _repeated(a, kw, ctx, depth) else {}),
                **({"mtp_moe_on_empty_chunk": True} if not hybrid_mtp and _moe_on_empty_chunk(a, kw, ctx) else {}))


def _moe_on_empty_chunk(a: Args, kw: Mapping[str, Any], ctx: Context) -> bool:
    """Whether an MoE model's MTP layer takes the MoE layer spec when its chunk holds no decoder layer.
    megatron-core 0.19.2 builds pretrain_gpt.py's model with megatron/training/models/gpt.py (training.py
    _build_model_wrapper: ``cfg.model.get_builder_cls()``), whose ``mtp_block_spec`` takes
    ``_te_or_local_layer_spec`` (the layer spec with ``num_moe_experts``: MoE) when the stage's block spec has no
    layers, else the global last decoder layer's spec. 0.16.1 to 0.18.2 build through gpt_builders.py's
    ``decoder_layer_specs[-1]`` (the last decoder layer; 0.18.2's megatron/training/models has no GPT builder),
    and so does Megatron-Bridge's GPTModelProvider (gpt_provider.py mtp_block_spec re-derives the last decoder
    layer, Bridge 0.6.2): only Megatron-LM's command line in 0.19 takes the MoE spec. A ``--spec`` module
    replaces the default block spec (its own rule)."""
    return (ctx.version >= Version("0.19") and kw.get("moe") is not None
            and a.key("mtp_num_layers").startswith("--") and not a.given("spec"))


def _repeated(a: Args, kw: Mapping[str, Any], ctx: Context, depth: int) -> bool:
    """--mtp-use-repeated-layer: MultiTokenPredictionBlock._build_layers (core 0.19.2, the same in 0.17.1 and
    0.18.2; no such field in 0.16.1) builds one MTP layer and applies it at every depth: its parameters (enorm,
    hnorm, eh_proj, the transformer layer, final norm) once, its activations at each of the D depths."""
    if not a.bool_arg("mtp_use_repeated_layer", False):
        return False
    key = a.key("mtp_use_repeated_layer")
    if ctx.version < Version("0.17"):
        a.fail("mtp_use_repeated_layer", "needs megatron-core 0.17")
        return False
    # (under CUDA graphs: resolve/cuda_graphs.py _repeated_mtp_layer)
    if depth > 1 and (kw.get("use_torch_fsdp2") or a.bool_arg("use_torch_fsdp2", False)):
        # TorchFullyShardedDataParallel (core 0.19.2) fully_shards every TransformerLayer, the repeated MTP layer's one
        # too: one FSDP2 unit called D times. torch's FSDPParamGroup (torch 2.14 _fsdp_param_group.py) unshards it in
        # each call's pre_forward and reshards it in its post_forward, registers a post-backward hook per call, and
        # in backward unshards it again per depth (pre_backward) and reduce-scatters that depth's gradient into the
        # sharded one in its post_backward: never more than one unsharded copy, as one unit (estimator/fsdp.py windows
        # of layers_built units; the hook order and the summed gradient checked on CPU, tests/e2e/fsdp2_repeated_unit.py)
        a.notes.append(f"{key}: one FSDP2 unit for the {depth} depths ({a.key('use_torch_fsdp2')}), gathered and "
                       "released at each call, its gradient reduce-scattered after each depth's backward")
    if depth > 1:
        a.notes.append(f"{key}: one MTP layer's parameters for the {depth} depths; its activations are kept at "
                       "each depth")
    return True


def _full_recompute(a: Args, kw: Mapping[str, Any], depth: int, ctx: Context) -> None:
    """Full recompute of the MTP depths: MultiTokenPredictionLayer._checkpointed_forward
    (transformer/multi_token_prediction.py; the same in megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2, the
    releases memguard reads) asserts ``recompute_num_layers == 1`` under uniform, at the first training
    forward (validate_args and TransformerConfig let the pair through), and under block warns and runs the
    depths without recompute (estimator/mtp.py checkpointed)."""
    if kw.get("recompute_granularity") != "full":
        return
    rnl, method = kw.get("recompute_num_layers"), kw.get("recompute_method")
    if method == "uniform" and rnl is not None and rnl > 1:   # (0 is refused by the recompute section)
        mtp_of = (a.key("mtp_num_layers") if not kw.get("hybrid_mtp_pattern") or a.given("mtp_num_layers") else
                  f"the MTP depths of {a.key('hybrid_layer_pattern' if a.given('hybrid_layer_pattern') else 'hybrid_override_pattern')}")
        a.fail("recompute_num_layers", f"must be 1 with {mtp_of} under {a.key('recompute_method')} "
               f"uniform, got {rnl}: MultiTokenPredictionLayer asserts \"recompute_num_layers must be 1 for MTP "
               "recompute\" at the first forward", f"give 1, or {a.key('recompute_method')} block, which does not "
               "recompute the MTP layers",
               fails_later="at the first forward step (MultiTokenPredictionLayer._checkpointed_forward asserts)")
    elif method == "uniform" and kw.get("distribute_saved_activations"):
        _distributed_checkpoint(a, kw, depth, ctx)
    elif method == "block" and kw.get("hybrid_mtp_pattern"):
        k = rnl if rnl is not None else 1
        a.notes.append(f"{a.key('recompute_method')} block does not checkpoint the {depth} hybrid MTP depth(s) "
                       "(Megatron warns \"not supported for MTP yet\"), but each depth's HybridStack checkpoints its "
                       f"first {k} layer(s) (recompute.py checkpointed_forward, the model's settings)")
    elif method == "block":
        a.notes.append(f"{a.key('recompute_method')} block does not recompute the {depth} MTP layer(s) "
                       "(Megatron warns \"not supported for MTP yet\" and runs them plainly): they keep all their "
                       "activations; --recompute-num-layers counts decoder layers only")


def _distributed_checkpoint(a: Args, kw: Mapping[str, Any], depth: int, ctx: Context) -> None:
    """--distribute-saved-activations with the MTP depths checkpointed (uniform). CheckpointFunction.forward
    (tensor_parallel/random.py; TE's _CheckpointFunction alike) replaces its first input's ``.data`` by this rank's
    1-D 1/TP shard: for an MTP depth that is ``hidden_states`` (MultiTokenPredictionLayer._checkpointed_forward,
    multi_token_prediction.py, megatron-core 0.16.1 and 0.19.2). At depth 1 it is a viewless copy
    (make_viewless_tensor) of the decoder output's torch.chunk view, so only the shard stays (estimated:
    estimator/mtp.py); from depth 2 it is the depth before's output itself, the tensor MultiTokenPredictionBlock
    appended to its hidden_states_list, which torch.cat then meets 1-D: "Tensors must have same number of
    dimensions" (reproduced with megatron-core 0.16.1's and 0.19.2's CheckpointFunction and make_viewless_tensor on
    CPU). 0.16.1 under FP8 hands te_checkpoint every input as a keyword, so TE's ``args[0]`` does not exist."""
    mtp_of = a.key("mtp_num_layers")
    if depth > 1:
        a.fail("distribute_saved_activations", f"does not work with {depth} MTP depths ({mtp_of}) under uniform "
               "recompute: the second depth's checkpoint shards the first depth's output, which "
               "MultiTokenPredictionBlock then concatenates (torch.cat: \"Tensors must have same number of "
               "dimensions\")", f"drop {a.key('distribute_saved_activations')}, or use one MTP depth",
               fails_later="at the first forward step (MultiTokenPredictionBlock.forward)")
    elif ctx.version < Version("0.17") and kw.get("fp8"):
        a.fail("distribute_saved_activations", f"does not work with {mtp_of} under uniform recompute and FP8 in "
               "megatron-core 0.16 (MultiTokenPredictionLayer passes te_checkpoint its inputs as keywords: Transformer "
               "Engine's checkpoint finds no first input to shard)", f"drop {a.key('distribute_saved_activations')}",
               fails_later="at the first forward step (te_checkpoint)")
