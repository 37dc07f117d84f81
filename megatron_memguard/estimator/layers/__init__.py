"""Layer kinds as recipes: one module per token mixer (``attention``, ``mla``) and per MLP (``dense``).

A transformer layer of kind ``LayerKind(mixer, mlp)`` (``megatron_memguard.partition``) is built from
the recipe of its mixer, the recipe of its MLP and the norms between them. A new kind is one module
here plus one entry below (and the line in ``partition.model_kind_runs`` that says which layers have it).
"""
from __future__ import annotations

from types import ModuleType

from functools import lru_cache
from typing import Any

from ...partition import (MIXER_ATTENTION, MIXER_DSA, MIXER_DSA_SHARED, MIXER_GDN, MIXER_LINEAR, MIXER_MAMBA, MIXER_MLA, MIXER_NONE, MLP_DENSE,
                          MLP_LINEAR, MLP_MOE, MLP_NONE, LayerKind)
from . import attention, dsa, gdn, linear_block, mamba, mla, mlp, moe, noop

MIXERS: dict[str, Any] = {MIXER_ATTENTION: attention, MIXER_MLA: mla, MIXER_DSA: dsa, MIXER_DSA_SHARED: dsa, MIXER_NONE: noop,
                          MIXER_LINEAR: linear_block.recipe("mixer"), MIXER_MAMBA: mamba, MIXER_GDN: gdn}
MLPS: dict[str, Any] = {MLP_DENSE: mlp, MLP_MOE: moe, MLP_NONE: noop, MLP_LINEAR: linear_block.recipe("mlp")}


def mixer_recipe(kind: LayerKind) -> ModuleType:
    return MIXERS[kind.mixer]


def mlp_recipe(kind: LayerKind) -> ModuleType:
    m = MLPS.get(kind.mlp)
    return m if m is not None else MLPS[kind.mlp.split(":", 1)[0]]


@lru_cache(maxsize=256)
def kind_layout(L: Any, kind: LayerKind) -> Any:
    """The layout a kind's recipes read: the model's, or for the dense MLP of another width
    ("dense:FFN", a heterogeneous layer config's ffn_mult) the model's with that ffn_hidden_size
    (HeterogeneousTransformerConfig.get_config_for_layer overrides it per layer), and for an attention of its
    own query groups (a block's ``num_query_groups``, overridden the same way) the model's with those, and for a DSA
    layer that reuses another's top-k the model's marked so (``dsa_skip_topk``)."""
    own = {}
    if ":" in kind.mlp:
        own["ffn_hidden_size"] = int(kind.mlp.split(":", 1)[1])
    if kind.query_groups:
        own["num_query_groups"] = kind.query_groups
    if kind.mixer == MIXER_DSA_SHARED:
        own["dsa_skip_topk"] = True      # a DSA layer reusing another's top-k: no indexer (layers/dsa.py)
    if kind.cp_comm:
        own.update(cp_comm_settings(L, kind.cp_comm))
    return L.replace(**own) if own else L


def cp_comm_settings(L: Any, word: str) -> dict[str, Any]:
    """The layout settings of one layer's context-parallel communication type (a word of ``cp_comm_layers``,
    resolve/shape.py ``cp_attention``): the all-to-all's ranks (``a2a``: every CP rank; ``a2a+p2p:N``: N, around a
    ring over the others; ``p2p``, ``all_gather``: none) and, for ``all_gather`` with FP8 attention, Transformer
    Engine's FP8 all-gather path from TE 2.15 (``AttnFuncWithCPAndKVAllGather`` takes ``fp8``) or, before it, BF16
    attention in that layer (no ``fp8`` argument: the p2p layers beside it still run FP8)."""
    name, _, size = word.partition(":")
    own: dict[str, Any] = {"cp_a2a_size": int(size) if size else (L.cp if name == "a2a" else 1),
                           "cp_kv_all_gather": False}
    if name == "all_gather" and L.fp8_spec.fp8_dot_product_attention:
        from ..te_release import AG_FP8_SINCE, te_at_least
        if te_at_least(L.env_dict, L.megatron_version, AG_FP8_SINCE):
            own["cp_kv_all_gather"] = True
        else:
            own["fp8_dot_product_attention"] = False
    return own


__all__ = ["LayerKind", "MIXERS", "MLPS", "cp_comm_settings", "kind_layout", "mixer_recipe", "mlp_recipe"]
