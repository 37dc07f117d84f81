"""Section: activation recomputation (validate_args + TransformerConfig.__post_init__)."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from .args import Args, Context

RECOMPUTE_MODULES = {"core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj", "mhc",
                     "gdn_norm_out"}


def granularity(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The granularity, with the deprecated alias --recompute-activations (validate_args deletes it
    after use, early: read here in the same place so errors come in Megatron's order)."""
    recompute_granularity = a.get("recompute_granularity")
    if a.bool_arg("recompute_activations", False):
        recompute_granularity = "selective"
    return dict(recompute_granularity=recompute_granularity)


def recompute(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    recompute_granularity, tp, sp = kw["recompute_granularity"], kw["tensor_model_parallel_size"], kw["sequence_parallel"]
    method = a.get("recompute_method")
    # 0 is a value Megatron takes (TransformerConfig.__post_init__ only refuses None with full recompute).
    rnl = a.int_arg("recompute_num_layers", minimum=0)
    modules = a.get("recompute_modules")
    if isinstance(modules, str):
        modules = modules.replace(",", " ").split()
    elif modules is not None and not isinstance(modules, (list, tuple)):
        a.fail("recompute_modules", f"must be a list of module names, got {modules!r}")
        modules = None
    if recompute_granularity not in (None, "full", "selective"):
        a.fail("recompute_granularity", f"must be full or selective, got {recompute_granularity!r}")
    moe_layer_recompute = a.bool_arg("moe_layer_recompute", False)
    if moe_layer_recompute:
        # TransformerConfig.__post_init__ (core 0.16 and 0.19): the deprecated switch means selective
        # recompute with 'moe' added to the modules, and refuses full granularity
        if recompute_granularity == "full":
            a.fail("moe_layer_recompute", "Do not set --moe-layer-recompute with full recompute granularity")
        else:
            recompute_granularity = "selective"
    if recompute_granularity == "full":
        if method not in ("uniform", "block"):
            a.fail("recompute_method", "full recompute needs --recompute-method uniform or block")
        if rnl is None:
            if a.get("recompute_num_layers") is None:   # (a bad value is reported by int_arg)
                a.fail("recompute_num_layers", "full recompute needs --recompute-num-layers")
        elif rnl == 0 and method == "uniform":
            # checkpointed_forward's uniform loop advances by recompute_num_layers: with 0 the
            # first forward never ends (TransformerBlock, megatron-core 0.14-0.16; core/recompute.py 0.19).
            a.fail("recompute_num_layers", "0 with --recompute-method uniform never finishes a forward "
                   "(Megatron's uniform loop advances by --recompute-num-layers)",
                   "give >= 1, or --recompute-method block with 0 to checkpoint no layer")
        elif rnl == 0:
            # Block: layers with index < recompute_num_layers are checkpointed, so none are; launch
            # scripts use this as an off switch.
            a.notes.append("--recompute-method block --recompute-num-layers 0 checkpoints no layer: "
                           "estimated as no recomputation")
    elif recompute_granularity == "selective":
        if method is not None:
            a.fail("recompute_method", "is not supported with selective recompute")
        if rnl is not None:
            # TransformerConfig.__post_init__: "recompute_num_layers must be None" with selective.
            a.fail("recompute_num_layers", "must not be given with selective recompute")
        method, rnl = None, None
    else:
        if method is not None or rnl is not None:
            a.notes.append("--recompute-method/--recompute-num-layers ignored without --recompute-granularity")
        method, rnl = None, None
    if modules is None:
        modules = ["core_attn"]
    if moe_layer_recompute and recompute_granularity == "selective" and "moe" not in modules:
        modules = list(modules) + ["moe"]
    for m in modules:
        if m not in RECOMPUTE_MODULES:
            a.fail("recompute_modules", f"unknown module {m!r}; known: {', '.join(sorted(RECOMPUTE_MODULES))}")
        elif (m == "mla_up_proj" and recompute_granularity == "selective"
              and not a.bool_arg("multi_latent_attention", False)):
            a.fail("recompute_modules", "mla_up_proj needs --multi-latent-attention (TransformerConfig)")
        elif m == "gdn_norm_out" and ctx.version < Version("0.19"):
            # TransformerConfig's allowed_modules (core 0.16.1, 0.17.1, 0.18.2) has no gdn_norm_out
            a.fail("recompute_modules", "gdn_norm_out is not a module of megatron-core "
                   f"{ctx.version.major}.{ctx.version.minor} (added in 0.19)")
        elif (m == "gdn_norm_out" and recompute_granularity == "selective"
              and a.get("experimental_attention_variant") != "gated_delta_net"):
            # TransformerConfig.__post_init__ (core 0.19.2) raises, also for a hybrid model's 'G' layers
            a.fail("recompute_modules", "gdn_norm_out needs --experimental-attention-variant gated_delta_net "
                   "(TransformerConfig)")
    distribute_saved = a.bool_arg("distribute_saved_activations", False)
    if distribute_saved and (tp == 1 or recompute_granularity != "full"):
        a.fail("distribute_saved_activations", "needs full recompute and tensor-model-parallel size > 1")
    elif distribute_saved and sp:
        # TransformerConfig.__post_init__ refuses the pair.
        a.fail("distribute_saved_activations", "cannot be combined with --sequence-parallel")
    return dict(recompute_granularity=recompute_granularity, recompute_method=method, recompute_num_layers=rnl,
                recompute_modules=tuple(modules),
                distribute_saved_activations=distribute_saved)


def uniform_group_violation(L: Any) -> tuple[str, str, str] | None:
    """(flag, one-line rule, hint) when megatron-core 0.16's uniform full recompute runs past a chunk's layers, else None.

    TransformerBlock._checkpointed_forward (core 0.16.1 transformer_block.py) checkpoints ``custom(layer_idx,
    layer_idx + recompute_num_layers)`` while ``layer_idx`` < the chunk's layers, and ``custom`` reads
    ``self.layers[index]`` for each index of the group: a chunk (pipeline stage or virtual stage) whose layer count
    is not a multiple of --recompute-num-layers has a last group past its layers, an IndexError at the first
    forward. From 0.17.1 the group ends at ``min(layer_idx + recompute_num_layers, layers)`` (transformer_block.py,
    ``recompute.py`` from 0.18), which the estimate models. Hybrid Mamba stacks have their own forward."""
    k = L.recompute_num_layers
    if (L.recompute_granularity != "full" or L.recompute_method != "uniform" or not k or k == 1
            or Version(L.megatron_version) >= Version("0.17") or L.hybrid_layer_pattern):
        return None
    from ..partition import partition_layers
    bad = sorted({c.num_layers for c in partition_layers(L) if c.num_layers % k})
    if not bad:
        return None
    return ("recompute_num_layers",
            f"{k} under --recompute-method uniform does not divide a model chunk of {bad[0]} layers: megatron-core "
            f"{L.megatron_version}'s uniform loop reads a layer past the chunk (IndexError at the first forward; "
            "0.17 ends the last group at the chunk's end)",
            "give a divisor of every chunk's layer count, or --recompute-method block")
