"""The linear replacement of a heterogeneous layer config's attention or MLP (``replace_with_linear:
true``; megatron-core 0.19.2 transformer/heterogeneous/linear_replacements.py): one column-parallel
[h, h] linear (TELayerNormColumnParallelLinearGathered with its norm fused in the TE spec,
ColumnParallelLinearGathered after the layer's norm module in the local spec), bias with
--add-bias-linear, whose [s b, h/t] output is all-gathered back to the residual stream (under sequence
parallelism megatron-core's gather fails; resolve/heterogeneous.py says so).

One module serves as a mixer recipe and as an MLP recipe (see ``base``). The norm before it and its
input are the layer composition's, as for attention and the dense MLP (``estimator.activations``)."""
from __future__ import annotations

from typing import Any

from .base import (MixerActivations, MlpActivations, Param, ParamRow, norm_rows, norms_per_layer_norm, param_objects,
                   shapes, wgrad)


def linear_shapes(L: Any, role: str = "mixer") -> dict[str, tuple[int, int]]:
    """[h / TP, h], named by its role's tp_comm_buffer_name (heterogeneous_layer_specs.py: linear_attn,
    linear_mlp), so that a layer of two linear replacements has two GEMMs."""
    return {"linear_attn" if role == "mixer" else "linear_mlp": (L.hidden_size // L.tp, L.hidden_size)}


def _rows(L: Any, module: str, local_norm: str) -> list[ParamRow]:
    h = L.hidden_size
    te = L.transformer_impl == "transformer_engine"
    rows = norm_rows(f"{module}.layer_norm" if te else local_norm, h, L)
    rows.append((f"{module}.weight", h // L.tp * h, False, False, False, 0))
    if L.add_bias_linear:
        rows.append((f"{module}.bias", h // L.tp, False, False, False, 0))
    return rows


def mixer_param_rows(L: Any) -> list[ParamRow]:
    return _rows(L, "self_attention", "input_layernorm")


def mlp_param_rows(L: Any) -> list[ParamRow]:
    return _rows(L, "mlp", "pre_mlp_layernorm")


def mixer_params(L: Any, prefix: str = "") -> list[Param]:
    return param_objects(mixer_param_rows(L), prefix)


def mlp_params(L: Any, prefix: str = "") -> list[Param]:
    return param_objects(mlp_param_rows(L), prefix)


def param_count(L: Any) -> int:
    h = L.hidden_size
    return norms_per_layer_norm(L) * h + h * h + (h if L.add_bias_linear else 0)


def _gather_bytes(L: Any) -> int:
    """Working bytes of the output's gather back to [s b, h]: the [s b, h/t] output and, with TP > 1,
    the all-gathered copy (with sequence parallelism Megatron's gather fails: resolve refuses it)."""
    x = shapes(L)
    out = x.Tf * (x.h // L.tp) * x.e
    return out if L.tp == 1 else out + x.Tf * x.h * x.e


def activations(L: Any, mods: set, *rest: Any) -> Any:
    """As a mixer (``mods, has_batch_mask, drop_norm, after, released, G``) or as an MLP (``mods, G``):
    the linear keeps only its input (the norm output: ``qkv_input`` as a mixer, the composition's
    ``fc1_input`` as an MLP); its backward gathers the output gradient, then dgrad and wgrad."""
    x = shapes(L)
    T, Tf, h, e = x.T, x.Tf, x.h, x.e
    G = rest[-1]
    bwd_linear = Tf * h * e + Tf * (h // L.tp) * e + wgrad(L, h // L.tp, h)
    if len(rest) == 1:
        return MlpActivations(saved={}, names=frozenset(), bwd_steps=((frozenset(), G + bwd_linear),),
                              released=frozenset(), fwd_steps=((frozenset(), _gather_bytes(L)),))
    _has_batch_mask, drop_norm, after, released, _G = rest
    from .base import norm_stats
    saved: dict[str, int] = {"norm1_stats": norm_stats(L, T)}
    if not drop_norm:
        saved["qkv_input"] = T * h * e                    # the norm output, kept by the linear (local shard under SP)
    rel_lin = released | {"qkv_input"}
    bwd_steps = (
        (released, G + bwd_linear),                                                               # the linear
        (rel_lin, G + Tf * h * e + T * h * e + (T * h * e if drop_norm else 0)),                  # input norm
    )
    return MixerActivations(saved=saved, fwd_steps=((after, _gather_bytes(L)),), bwd_steps=bwd_steps)


def bound_saved(L: Any, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    return 0


def recipe(role: str) -> Any:
    """This module as the recipe of one role (the parameters' names differ)."""
    from types import SimpleNamespace
    mixer = role == "mixer"
    return SimpleNamespace(linear_shapes=lambda L: linear_shapes(L, role), params=mixer_params if mixer else mlp_params,
                           param_rows=mixer_param_rows if mixer else mlp_param_rows,
                           param_count=param_count, activations=activations, bound_saved=bound_saved,
                           reads_batch_mask=lambda L: False)
