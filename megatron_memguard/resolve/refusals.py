"""Settings that change memory in ways memguard does not model yet: refuse rather than guess.

Data, not code: when a feature gets modelled (its own resolve section, its layer recipe), its row
goes away here. Each row: (Megatron dest, predicate on the value, what it is, as the refusal says it).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import NotModelledError
from .args import Args, Context

Row = tuple[str, Callable[[Any], bool], str]

# megatron-core's own hybrid stack spec, as Megatron-LM's Mamba scripts name it (--spec MODULE NAME): the spec
# memguard models (0.16.1 models/mamba/mamba_layer_specs.py mamba_stack_spec; 0.19.2 re-exports it from
# models/hybrid/hybrid_layer_specs.py, where hybrid_stack_spec is the same object)
HYBRID_STACK_SPECS = {("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"),
                      ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"),
                      ("megatron.core.models.hybrid.hybrid_layer_specs", "mamba_stack_spec")}


def hybrid_stack_spec(value: Any) -> bool:
    """Whether ``--spec`` names megatron-core's default hybrid stack spec."""
    parts = value.split() if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    return tuple(str(p) for p in parts) in HYBRID_STACK_SPECS

NOT_MODELLED: list[Row] = [
    # (--hybrid-attention-ratio / --hybrid-mlp-ratio: resolve/hybrid.py derives the pattern as megatron-core does)
    ("perform_rl_step", bool, "RL training steps (the rollout's inference KV cache and CUDA graphs, sized by the "
     "--inference-dynamic-batching-* and --rl-* settings and the generated lengths, share the GPU with training)"),
    ("export_kd_teacher_load", lambda v: bool(v), "knowledge distillation with a teacher model (its layers, size and "
     "dtype come from the teacher checkpoint and --export-kd-cfg, not from the student's flags)"),
    # (DSA is modelled: resolve/dsa.py; gated delta net: resolve/gdn.py)
    # found by the option-table walk (tests/test_option_table.py): memory-changing options nothing modelled
    ("hybrid_context_parallel", bool, "hybrid context parallelism (each packed sub-sample runs on a CP group "
     "sized from its length per global batch, up to --max-seqlen-per-dp-cp-rank tokens a rank)"),
    ("use_kitchen_attention", bool, "kitchen attention (NVIDIA's kitchen library, not public, decides its "
     "saved tensors and workspaces)"),
    ("logits_load_dir", lambda v: bool(v), "distillation from stored logits (the teacher's top-K per token and "
     "its dtype come from the stored files, not from the flags)"),
    ("te_precision_config_file", lambda v: bool(v), "per-module Transformer Engine precision recipes (matched to "
     "modules by glob; memguard sizes one recipe for every GEMM: for an estimate give the recipe most GEMMs use as "
     "--fp8-recipe / --fp4-recipe)"),
    ("spec", lambda v: bool(v) and not hybrid_stack_spec(v), "a custom layer spec (--spec)"),
    # the flag and namespace readers replace --yaml-cfg by the file's settings; still set here, it was not read
    ("yaml_cfg", lambda v: bool(v), "settings from a --yaml-cfg file memguard did not read (give the flags as "
     "memguard estimate -- --yaml-cfg FILE)"),
]
# Estimated, with a note saying what is not counted.
WARN_ONLY: list[Row] = [
    # found by the option-table walk: small or unanalysed effects, estimated with the note
    ("clone_scatter_output_in_embedding", lambda v: v is False or str(v).lower() in ("false", "0"),
     "without the clone the sequence-parallel embedding output keeps the full [s, b, h] tensor alive (not counted)"),
    ("sgd_momentum", lambda v: str(v) in ("0", "0.0"), "FusedSGD keeps no momentum buffer with momentum 0; "
     "memguard counts one (the estimate errs high)"),
    ("overlap_p2p_comm_warmup_flush", bool, "early warm-up/flush receives of the interleaved schedule are not modelled"),
    ("disable_jit_fuser", bool, "without the JIT fuser the fused bias/dropout/activation functions keep intermediates memguard does not count"),
    ("ddp_num_buckets", lambda v: bool(v), "bucket padding is computed for --ddp-bucket-size, not for a bucket count (a few KiB)"),
    ("create_all_gather_group", bool, "the extra all-gather communicator's NCCL buffers are not counted"),
    ("moe_router_force_biased", lambda v: v is not None, "forced biased routing (random logits plus a per-expert "
     "bias every rank shares) sends more tokens to some experts than balanced routing: the balanced estimate "
     "understates those ranks; plan with the worst-case figure (moe.worst_case), which bounds them"),
    ("ep_overlap_early_attn_memory_release", bool, "the early release of attention memory under EP overlap is not modelled (the estimate errs high)"),
]
# The optimizers whose states are modelled: every --optimizer choice of megatron-core 0.19.2.
OPTIMIZERS = ("adam", "sgd", "muon", "adaptive_muon", "dist_muon", "lion", "soap")


def refuse(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Raise NotModelledError for the first refused setting; note the warn-only ones. Returns the
    optimizer (the one refusal that is also a value of the Layout)."""
    # (dict.get: a launch script's $(...) text is a value given, so --logits-load-dir $(cat dir) is the refusal, not
    # the unevaluated-value error a rule reading its value gets)
    for dest, pred, what in NOT_MODELLED:
        v = dict.get(a.a, dest)
        if v is not None and pred(v):
            raise NotModelledError(a.key(dest), what)
    for dest, pred, what in WARN_ONLY:
        v = dict.get(a.a, dest)
        if v is not None and pred(v):
            a.notes.append(f"{a.key(dest)}: {what}")
    optimizer = str(a.get("optimizer", "adam")).lower()
    if optimizer not in OPTIMIZERS:
        # the optimizers of NeMo's registry memguard does not model (Megatron's own choices are all modelled)
        raise NotModelledError(a.key("optimizer"), f"the {optimizer[:40]!r} optimizer (its state)")
    return {"optimizer": optimizer}
