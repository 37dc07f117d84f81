"""Layer kinds as recipes: one module per token mixer (``attention``, ``mla``) and per MLP (``dense``).

A transformer layer of kind ``LayerKind(mixer, mlp)`` (``megatron_memguard.partition``) is built from
the recipe of its mixer, the recipe of its MLP and the norms between them. A new kind is one module
here plus one entry below (and the line in ``partition.model_kind_runs`` that says which layers have it).
"""
from __future__ import annotations

from types import ModuleType

from ...partition import MIXER_ATTENTION, MIXER_MLA, MLP_DENSE, MLP_MOE, LayerKind
from . import attention, mla, mlp, moe

MIXERS: dict[str, ModuleType] = {MIXER_ATTENTION: attention, MIXER_MLA: mla}
MLPS: dict[str, ModuleType] = {MLP_DENSE: mlp, MLP_MOE: moe}


def mixer_recipe(kind: LayerKind) -> ModuleType:
    return MIXERS[kind.mixer]


def mlp_recipe(kind: LayerKind) -> ModuleType:
    return MLPS[kind.mlp]


__all__ = ["LayerKind", "MIXERS", "MLPS", "mixer_recipe", "mlp_recipe"]
