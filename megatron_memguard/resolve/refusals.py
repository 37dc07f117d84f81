"""Settings that change memory in ways memguard does not model yet: refuse rather than guess.

Data, not code: when a feature gets modelled (its own resolve section, its layer recipe), its row
goes away here. Each row: (Megatron dest, predicate on the value, what it is, as the refusal says it).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import NotModelledError
from .args import Args, Context

Row = tuple[str, Callable[[Any], bool], str]

NOT_MODELLED: list[Row] = [
    ("num_experts", lambda v: bool(v), "mixture of experts (--num-experts)"),
    ("mtp_num_layers", lambda v: bool(v), "multi-token prediction layers"),
    ("hybrid_layer_pattern", lambda v: bool(v), "hybrid (Mamba) layer patterns"),
    ("heterogeneous_layers_config_path", lambda v: bool(v), "heterogeneous layer configs"),
    ("fp8", lambda v: bool(v), "FP8 training (--fp8-format)"),
    ("fp4", lambda v: bool(v), "FP4 training (--fp4-format)"),
    ("cpu_offloading_num_layers", lambda v: bool(v), "activation CPU offloading"),
    ("fine_grained_activation_offloading", bool, "fine-grained activation offloading"),
    ("optimizer_cpu_offload", bool, "optimizer CPU offloading"),
    ("use_megatron_fsdp", bool, "Megatron-FSDP"),
    ("use_torch_fsdp2", bool, "torch FSDP2"),
    ("use_custom_fsdp", bool, "Megatron-FSDP"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"), "CUDA graphs (their memory pools)"),
    ("enable_cuda_graph", bool, "CUDA graphs (their memory pools)"),
    ("external_cuda_graph", bool, "CUDA graphs (their memory pools)"),
    ("tensor_parallel_num_weight_shards", lambda v: v not in (None, 1), "GTP weight rematerialisation"),
    ("delay_wgrad_compute", bool, "delayed weight-gradient computation"),
    ("nccl_ub", bool, "NCCL user-buffer memory pools (--use-nccl-ub)"),
    ("perform_rl_step", bool, "RL training steps"),
    ("export_kd_teacher_load", lambda v: bool(v), "knowledge distillation (a second, teacher model)"),
    ("attention_output_gate", bool, "gated attention output"),
    ("experimental_attention_variant", lambda v: bool(v), "experimental attention variants (gated delta net, DSA)"),
]
# Estimated, with a note saying what is not counted.
WARN_ONLY: list[Row] = [
    ("tp_comm_overlap", bool, "TP communication overlap allocates userbuffers (a few hundred MiB) that memguard does not count"),
]
# Only these optimizers' states are modelled (the layer-wise distributed optimizers shard differently).
OPTIMIZERS = ("adam", "sgd")


def refuse(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Raise NotModelledError for the first refused setting; note the warn-only ones. Returns the
    optimizer (the one refusal that is also a value of the Layout)."""
    for dest, pred, what in NOT_MODELLED:
        if dest in a.a and a.a[dest] is not None and pred(a.a[dest]):
            raise NotModelledError(a.key(dest), what)
    for dest, pred, what in WARN_ONLY:
        if dest in a.a and a.a[dest] is not None and pred(a.a[dest]):
            a.notes.append(f"{a.key(dest)}: {what}")
    optimizer = str(a.get("optimizer", "adam")).lower()
    if optimizer not in OPTIMIZERS:
        raise NotModelledError(a.key("optimizer"), f"the {optimizer!r} optimizer (layer-wise distributed optimizers)")
    return {"optimizer": optimizer}
