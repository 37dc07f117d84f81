"""Section: activation offloading to the host (``--cpu-offloading-num-layers``,
``--fine-grained-activation-offloading``) with TransformerConfig.__post_init__'s and validate_args's rules."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import NotModelledError
from .args import Args, Context

MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act", "fused_group_mlp")


def offload(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    layers = a.int_arg("cpu_offloading_num_layers", 0, minimum=0) or 0
    fine = a.bool_arg("fine_grained_activation_offloading", False)
    out: dict[str, Any] = dict(cpu_offloading_num_layers=layers, fine_grained_activation_offloading=fine,
                               offload_modules=(), min_offloaded_tensor_size=1024 * 1024)
    if layers:
        if layers >= kw["num_layers"]:
            a.fail("cpu_offloading_num_layers", f"({layers}) must be smaller than --num-layers {kw['num_layers']}")
        if kw["pipeline_model_parallel_size"] > 1:
            a.fail("cpu_offloading_num_layers", "does not work with pipeline parallelism (TransformerConfig)")
        if kw.get("recompute_granularity") and a.get("recompute_granularity") is None and a.bool_arg("moe_layer_recompute", False):
            # TransformerConfig.__post_init__ (transformer_config.py 0.19.2 lines 1719 and 1835) checks offloading
            # against recomputation before it turns --moe-layer-recompute into selective recompute: Megatron
            # starts the pair, whose interplay was not analysed
            raise NotModelledError(a.key("cpu_offloading_num_layers"), "layer-wise activation offloading together "
                                   "with the deprecated --moe-layer-recompute")
        if kw.get("recompute_granularity"):
            a.fail("cpu_offloading_num_layers", "cannot be combined with recomputation (TransformerConfig)")
        if fine:
            a.fail("fine_grained_activation_offloading", "cannot be combined with --cpu-offloading-num-layers")
    if fine:
        mods = a.get("offload_modules") or []
        text = " ".join(map(str, mods)) if isinstance(mods, (list, tuple)) else str(mods)
        mods = text.replace("[", " ").replace("]", " ").replace(",", " ").split()
        if not mods:
            a.fail("offload_modules", "must name at least one module with --fine-grained-activation-offloading")
        for m in mods:
            if m not in MODULES:
                a.fail("offload_modules", f"unknown module {m!r}; known: {', '.join(MODULES)}")
        if (kw.get("experimental_attention_variant") == "dsa" or "D" in (kw.get("hybrid_layer_pattern") or "")) and \
                set(mods) & {"qkv_linear", "core_attn", "attn_proj"}:
            # AbsorbedMLASelfAttention and DSAttention open no offload group (absorbed_mla.py, dsa.py 0.19.2): only the
            # input norm's and the MLP's groups move a DSA layer's tensors (estimator/core.py)
            a.notes.append(f"{a.key('offload_modules')}: qkv_linear, core_attn and attn_proj offload nothing of the DSA "
                           "layers (AbsorbedMLASelfAttention and DSAttention open no offload group, megatron-core "
                           "0.19.2): their attention tensors stay on the GPU")
        if "attn_proj" in mods and "core_attn" not in mods:
            a.fail("offload_modules", "attn_proj needs core_attn (its input is core_attn's output, which core_attn's "
                   "backward needs)")
        if "fused_group_mlp" in mods:
            mods = _fused_group_mlp(a, kw, ctx, mods)
        inside_moe = sorted({"moe_act", "expert_fc1", "fused_group_mlp"} & set(mods))
        if (ctx.version >= Version("0.19") and inside_moe and kw.get("recompute_granularity") == "selective"
                and "moe" in (kw.get("recompute_modules") or ())):
            # TransformerConfig.__post_init__ (transformer_config.py 0.19.2 line 1874; not in core 0.16.1)
            a.fail("offload_modules", f"cannot offload {', '.join(inside_moe)} while 'moe' recompute recomputes the "
                   "whole MoE layer")
        if kw.get("transformer_impl") != "transformer_engine":
            a.fail("fine_grained_activation_offloading", "needs --transformer-impl transformer_engine")
        size = a.int_arg("min_offloaded_tensor_size", 1024 * 1024, minimum=0)
        # core 0.19 tuning knobs (PipelineOffloadManager.post_warmup_callback, FineGrainedOffloadingGroupCommitFunction)
        if ctx.version < Version("0.19"):
            # none of them is a TransformerConfig field in core 0.16.1
            for dest in ("activation_offload_fraction", "delta_offload_bytes_across_pp_ranks",
                         "delay_offload_until_cuda_graph", "fine_grained_offloading_max_inflight_offloads"):
                # the in-flight cap is a TransformerConfig field (and so a flag) from core 0.18.2 on
                # (transformer_config.py, ChunkOffloadHandler._drain_offload_pending as in 0.19.2)
                if dest == "fine_grained_offloading_max_inflight_offloads" and ctx.version >= Version("0.18"):
                    continue
                if a.get(dest) not in (None, False, 1.0, 0):
                    a.fail(dest, "needs megatron-core " + ("0.18" if dest.endswith("inflight_offloads") else "0.19"))
        fraction = a.float_arg("activation_offload_fraction", 1.0)
        if not 0.0 <= fraction <= 1.0:
            a.fail("activation_offload_fraction", f"must be in [0, 1], got {fraction}")
            fraction = 1.0
        delta = a.int_arg("delta_offload_bytes_across_pp_ranks", 0, minimum=0) or 0
        delay = a.bool_arg("delay_offload_until_cuda_graph", False)
        if delay:
            # the commit queues its offload only during a TE graph replay (PipelineOffloadManager._in_replay)
            a.notes.append(f"{a.key('delay_offload_until_cuda_graph')}: a graphed layer's groups stay on the GPU "
                           "until its graph replay ends (only with --cuda-graph-impl transformer_engine)")
        cap = a.int_arg("fine_grained_offloading_max_inflight_offloads", minimum=0)
        if cap is None and ctx.version >= Version("0.18") and str(a.get("cuda_graph_impl") or "none") == "full_iteration":
            # TransformerConfig.__post_init__ (core 0.18.2 and 0.19.2): the full-iteration graph's main stream would
            # never wait on the D2H copies otherwise
            a.fail("fine_grained_offloading_max_inflight_offloads", "must be set (0 or more) with fine-grained "
                   "activation offloading under --cuda-graph-impl full_iteration (TransformerConfig)")
        if cap is not None and cap > 1:
            # ChunkOffloadHandler._drain_offload_pending (core 0.19.2): the main stream joins a name's older D2H
            # copies only past the cap, so up to `cap` copies per name can hold their GPU tensors at once
            a.notes.append(f"{a.key('fine_grained_offloading_max_inflight_offloads')} {cap}: offload_staging counts "
                           f"up to {cap} pending copies of every offloaded module (the bound); a D2H stream that "
                           "keeps pace leaves one pending, as without the cap")
        out.update(offload_modules=tuple(mods), min_offloaded_tensor_size=size, activation_offload_fraction=fraction,
                   delta_offload_bytes_across_pp_ranks=delta, delay_offload_until_cuda_graph=delay,
                   fine_grained_offloading_max_inflight_offloads=cap)
    return out


def _fused_group_mlp(a: Args, kw: Mapping[str, Any], ctx: Context, mods: list[str]) -> list[str]:
    """The 'fused_group_mlp' offload group (core 0.19.2 TEGroupedMLP._fused_forward, TransformerConfig.__post_init__):
    a 0.19 module name, which needs --use-transformer-engine-op-fuser and excludes expert_fc1 / moe_act. It wraps
    the experts' fused grouped MLP only: where the experts do not run it the group offloads nothing."""
    if ctx.version < Version("0.19"):
        # not among the offload_modules TransformerConfig accepts in core 0.16.1, 0.17.1 and 0.18.2
        a.fail("offload_modules", "fused_group_mlp needs megatron-core 0.19")
        return mods
    if not a.bool_arg("use_transformer_engine_op_fuser", False):
        a.fail("offload_modules", "fused_group_mlp needs --use-transformer-engine-op-fuser (TransformerConfig)")
        return mods
    partial = sorted({"expert_fc1", "moe_act"} & set(mods))
    if partial:
        a.fail("offload_modules", f"fused_group_mlp offloads the whole fused grouped MLP and cannot be combined with "
               f"{', '.join(partial)} (TransformerConfig)")
        return mods
    if kw.get("moe") is None or not kw.get("use_transformer_engine_op_fuser"):
        a.notes.append(f"{a.key('offload_modules')}: fused_group_mlp offloads nothing here (no experts run TE's fused "
                       "grouped MLP)")
        return [m for m in mods if m != "fused_group_mlp"]
    return mods
