"""Megatron-FSDP of a hybrid model's MTP depths ('/' in --hybrid-layer-pattern, megatron-core 0.17+): each layer of a
depth's HybridStack is an FSDP unit of its own (mcore_fsdp_adapter.py: fsdp_unit_modules = TransformerLayer,
MoETransformerLayer, MambaLayer, matched by class: MLPLayer is a TransformerLayer), the depth's enorm, hnorm, eh_proj
and final norm stay outside the units with the embedding, the decoder's final norm and the output layer."""
from __future__ import annotations

import importlib.util
import os

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.fsdp_layout import chunk_groups
from megatron_memguard.estimator.params import chunk_params, holds_final_norm, holds_mtp
from test_mamba import SMALL

FSDP = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion "
        "--ckpt-format fsdp_dtensor --use-distributed-optimizer").split()


def _layout(pattern: str):
    return layout_from_flags(SMALL + ["--hybrid-layer-pattern", pattern] + FSDP, world_size=2)


def test_the_unit_classes_include_mamba_layers():
    spec = importlib.util.find_spec("megatron.core")
    path = os.path.join(list(spec.submodule_search_locations)[0], "distributed", "fsdp", "mcore_fsdp_adapter.py") \
        if spec else ""
    if not os.path.exists(path) or "MambaLayer" not in open(path).read():
        pytest.skip("megatron-core 0.16 (no MTP in hybrid models, no MambaLayer unit)")
    assert "[TransformerLayer, MoETransformerLayer, MambaLayer]" in open(path).read()


@pytest.mark.parametrize("pattern, units", [
    ("M*M-", 4),
    ("M*M-/*-", 4 + 2),           # one depth of an attention and an MLP layer
    ("M*M-/M-/M-", 4 + 2 * 2),    # two depths of a Mamba and an MLP layer
])
def test_every_layer_of_an_mtp_depth_is_a_unit(pattern, units):
    L = _layout(pattern)
    c = L.chunks[0]
    groups = chunk_groups(L, c.kind_runs, c.has_embedding, c.has_output, False, holds_final_norm(L, c),
                          holds_mtp(L, c))
    # every parameter of the chunk (equal to megatron-core 0.19.2's HybridModel with its MTP block: test_hybrid_mtp.py)
    # is in exactly one group, one dense group per unit (no experts here)
    assert sum(g.numel for g in groups) == sum(p.numel for p in chunk_params(L, c))
    assert len({g.name for g in groups if g.unit}) == units
    outside = sum(g.numel for g in groups if not g.unit)
    h, depths = 256, pattern.count("/")
    # embedding and output layer [1024, 256] each, the decoder's final norm, per depth 3 norms and eh_proj [h, 2h]
    assert outside == 2 * 1024 * h + h + depths * (3 * h + h * 2 * h)


def test_the_estimate_shards_the_mtp_depths():
    # bf16 weights sharded over DP 2: the depth adds about half its parameters' bytes per rank (bucket padding aside)
    base = {t.name: t.bytes for t in estimate(_layout("M*M-")).critical.terms}
    mtp = {t.name: t.bytes for t in estimate(_layout("M*M-/*-")).critical.terms}
    L = _layout("M*M-/*-")
    added = sum(p.numel for p in chunk_params(L, L.chunks[0])) - sum(
        p.numel for p in chunk_params(_layout("M*M-"), _layout("M*M-").chunks[0]))
    grown = mtp["fsdp_parameters"] - base["fsdp_parameters"]
    assert added * 2 // 2 <= grown <= added * 2 // 2 + 4096
