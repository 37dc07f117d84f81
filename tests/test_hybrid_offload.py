"""Activation offloading in a hybrid Mamba model: layer-level (--cpu-offloading-num-layers) is not applied by
HybridStack, fine-grained offloading (--fine-grained-activation-offloading, megatron-core 0.18.2+) offloads the
attention / MLP layers' groups and nothing of a Mamba layer. Read from megatron-core 0.19.2 (models/hybrid/
hybrid_block.py, hybrid_model.py, ssm/mamba_layer.py, ssm/mamba_mixer.py); the tests also read the installed
megatron-core's source files, so a release that changes this fails them."""
from __future__ import annotations

import importlib.util
import os

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import NotModelledError
from test_mamba import SMALL

S, B, H = 2048, 2, 256
T = S * B
LONG = f"--micro-batch-size {B} --seq-length {S} --max-position-embeddings {S}".split()


def _est(pattern: str, extra: str = "", version: str | None = None):
    L = layout_from_flags(SMALL + ["--hybrid-layer-pattern", pattern] + LONG + extra.split(), world_size=1,
                          megatron_version=version)
    return L, {t.name: t for t in estimate(L).critical.terms}


def _core_source(*parts: str) -> str | None:
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    return open(path).read() if os.path.exists(path) else None


def test_layer_level_offloading_is_not_applied_to_a_hybrid_stack():
    # TE's get_cpu_offload_context is entered by TransformerBlock only; the hybrid stack runs its layers without it
    for parts in (("models", "hybrid", "hybrid_block.py"), ("ssm", "mamba_block.py")):
        src = _core_source(*parts)
        if src is not None and ("class HybridStack" in src or "class MambaStack" in src):
            assert "cpu_offload" not in src, parts
    src = _core_source("transformer", "transformer_block.py")
    if src is not None:
        assert "get_cpu_offload_context" in src
    L, off = _est("M*M-", "--cpu-offloading-num-layers 2")
    _, plain = _est("M*M-")
    assert "not applied to a hybrid model" in " ".join(L.notes)
    assert off["layer_activations"].bytes == plain["layer_activations"].bytes
    assert "host_offloaded_activations" not in off
    # TransformerConfig's rules on the flag still hold: fewer layers than the model's (the pattern's 4)
    with pytest.raises(Exception, match="--cpu-offloading-num-layers"):
        _est("M*M-", "--cpu-offloading-num-layers 4")


def test_mamba_layers_open_no_offload_group():
    # MambaLayer and MambaMixer call no fine-grained offload group (0.19.2 ssm/); a Mamba-only model offloads nothing
    for name in ("mamba_layer.py", "mamba_mixer.py"):
        src = _core_source("ssm", name)
        if src is not None:
            assert "offload" not in src, name
    flags = "--fine-grained-activation-offloading --offload-modules qkv_linear core_attn"
    _, off = _est("MMMM", flags)
    _, plain = _est("MMMM")
    assert off["layer_activations"].bytes == plain["layer_activations"].bytes
    assert "host_offloaded_activations" not in off and "offload_staging" not in off


def test_attention_layers_of_a_hybrid_model_offload_their_groups():
    # the '*' layer (a TransformerLayer, norm fused into linear_qkv) offloads qkv_linear: the layer input kept by the
    # fused norm and the norm output kept by linear_qkv, T x h bf16 each (>= the 1,048,576-element threshold); its
    # core_attn group is the chunk's last group (the Mamba and MLP layers above offload none) and stays on this, the
    # last, stage (should_bulk_offload, 0.19.2 fine_grained_activation_offload.py)
    assert T * H == 1_048_576
    flags = "--fine-grained-activation-offloading --offload-modules qkv_linear core_attn"
    _, off = _est("M*M-", flags)
    _, plain = _est("M*M-")
    qkv_linear = 2 * T * H * 2
    assert plain["layer_activations"].bytes - off["layer_activations"].bytes == qkv_linear == 4_194_304
    # one group's copy pending (capped by what left)
    assert off["offload_staging"].bytes == qkv_linear


def test_fine_grained_offloading_needs_megatron_core_018_with_a_hybrid_model():
    # HybridModel.preprocess_for_fine_grained_offloading came in 0.18.2 (0.17.1's HybridModel, 0.16.1's MambaModel
    # have none)
    src = _core_source("models", "hybrid", "hybrid_model.py")
    if src is not None:
        assert "preprocess_for_fine_grained_offloading" in src
    with pytest.raises(NotModelledError) as e:
        _est("M*M-", "--fine-grained-activation-offloading --offload-modules core_attn", version="0.17")
    assert str(e.value).startswith("--fine-grained-activation-offloading")
    _est("M*M-", "--fine-grained-activation-offloading --offload-modules core_attn", version="0.18")


@pytest.mark.parametrize("version", ["0.16", "0.17"])
def test_full_recompute_of_a_hybrid_stack_needs_megatron_core_018(version):
    # 0.16.1's and 0.17.1's MambaStack (ssm/mamba_block.py) run their layers one by one whatever
    # recompute_granularity says; HybridStack's checkpointed_forward (models/hybrid/hybrid_block.py) came in 0.18.2
    pat = "--hybrid-override-pattern M*M- --num-layers 4" if version == "0.16" else "--hybrid-layer-pattern M*M-"
    flags = pat + " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(SMALL + flags.split(), world_size=1, megatron_version=version)
    assert str(e.value).startswith("--recompute-granularity") and f"megatron-core {version}" in str(e.value)
    src = _core_source("ssm", "mamba_block.py")
    if src is not None and "class MambaStack" in src and "HybridStack" not in src:
        assert "checkpointed_forward" not in src and "recompute_granularity" not in src
    layout_from_flags(SMALL + "--hybrid-layer-pattern M*M-".split() + flags.split()[2:], world_size=1,
                      megatron_version="0.18")
