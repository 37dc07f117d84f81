"""Megatron-FSDP / torch FSDP2 for a resolved layout: its spec, and the parameter groups of a stage.

The bytes themselves are computed by ``fsdp.py`` from a spec and groups; this module only reads
the layout (flat Megatron names) and the per-rank parameter shapes of the layer recipes.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from .fsdp import FsdpGroup, FsdpSpec, StageFsdp, stage_fsdp, stage_groups
from .params import layer_linear_shapes, layer_params


def _flag(L: Any, name: str, default: Any = None) -> Any:
    return getattr(L, name, default)


def fsdp_enabled(L: Any) -> bool:
    return bool(_flag(L, "use_megatron_fsdp", False) or _flag(L, "use_torch_fsdp2", False))


@lru_cache(maxsize=256)
def fsdp_spec(L: Any) -> FsdpSpec:
    """The FsdpSpec of a layout that has Megatron-FSDP or torch FSDP2 on."""
    return FsdpSpec.from_flat(
        megatron_version=L.megatron_version, use_megatron_fsdp=bool(_flag(L, "use_megatron_fsdp", False)),
        use_torch_fsdp2=bool(_flag(L, "use_torch_fsdp2", False)),
        data_parallel_sharding_strategy=_flag(L, "data_parallel_sharding_strategy"),
        params_dtype=L.params_dtype, accumulate_allreduce_grads_in_fp32=L.accumulate_allreduce_grads_in_fp32,
        megatron_fsdp_main_params_dtype=_flag(L, "megatron_fsdp_main_params_dtype", "fp32") or "auto",
        megatron_fsdp_main_grads_dtype=_flag(L, "megatron_fsdp_main_grads_dtype", "auto") or "auto",
        use_precision_aware_optimizer=L.use_precision_aware_optimizer, optimizer=L.optimizer,
        exp_avg_dtype=L.exp_avg_dtype, exp_avg_sq_dtype=L.exp_avg_sq_dtype,
        fp8_param_gather=bool(_flag(L, "fp8_param_gather", False)),
        fsdp_double_buffer=bool(_flag(L, "fsdp_double_buffer", False)),
        suggested_communication_unit_size=_flag(L, "suggested_communication_unit_size"),
        ddp_bucket_size=L.ddp_bucket_size, overlap_grad_reduce=L.overlap_grad_reduce,
        overlap_param_gather=L.overlap_param_gather, data_parallel_size=L.data_parallel_size,
        context_parallel_size=L.context_parallel_size,
        torch_fsdp2_reshard_after_forward=bool(_flag(L, "torch_fsdp2_reshard_after_forward", True)))


def _shapes(L: Any) -> list[tuple[int, ...]]:
    """Per-rank shapes of one layer's parameters in registration order: [out, in] for the linear
    weights of the recipe, 1-D for norms and biases."""
    linear = layer_linear_shapes(L)
    out: list[tuple[int, ...]] = []
    for p in layer_params(L):
        key = p.name.rsplit(".", 2)
        name = key[-2] if len(key) >= 2 and key[-1] == "weight" else None
        if name in linear and linear[name][0] * linear[name][1] == p.numel:
            out.append(tuple(linear[name]))
        else:
            out.append((p.numel,))
    return out


def chunk_groups(L: Any, num_layers: int, has_embedding: bool, has_output: bool,
                 tied_copy: bool) -> tuple[FsdpGroup, ...]:
    """The FSDP parameter groups of one model chunk on one rank (dense parameters over DP x CP)."""
    spec = fsdp_spec(L)
    h, t = L.hidden_size, L.tensor_model_parallel_size
    rows = L.padded_vocab_size // t
    before: list[tuple[int, ...]] = []
    if has_embedding:
        before.append((rows, h))
        if L.position_embedding_type == "learned_absolute":
            before.append((L.max_position_embeddings, h))
    after: list[tuple[int, ...]] = []
    if has_output:
        after += [(h,)] * (2 if L.normalization == "LayerNorm" else 1)
        if L.untie_embeddings_and_output_weights or tied_copy:
            after.append((rows, h))
    dense_shard = max(1, L.data_parallel_size * L.context_parallel_size)
    return stage_groups(spec, layers=num_layers, layer_shapes=_shapes(L), before=before, after=after,
                        dense_shard=dense_shard)


def chunk_fsdp(L: Any, num_layers: int, has_embedding: bool, has_output: bool, tied_copy: bool,
               act_per_layer: int) -> StageFsdp:
    """States, windows and the after-step gather of one model chunk (Megatron wraps each chunk in
    its own FSDP module)."""
    return stage_fsdp(fsdp_spec(L), chunk_groups(L, num_layers, has_embedding, has_output, tied_copy),
                      act_per_layer)
