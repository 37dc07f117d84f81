"""Interleaved pipelines whose first/last stage flags leave no middle stage (PP 2 with both set).

TransformerConfig accepts them, but megatron-core's layer offset (transformer_layer.py
get_transformer_layer_offset, core 0.16.1 and 0.19.2) divides each chunk's middle layers by the number of
middle stages, 0 here: the last stage's model build stops with ZeroDivisionError. memguard refuses them.
"""
from __future__ import annotations

import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors

BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --global-batch-size 8 --bf16 --pipeline-model-parallel-size 2 "
        "--num-virtual-stages-per-pipeline-rank 2").split()


def test_both_first_and_last_at_pp2_with_vpp_is_refused_by_name():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(BASE + ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
                          world_size=2)
    assert "--decoder-first-pipeline-num-layers" in str(e.value) and "no middle stage" in str(e.value)


@pytest.mark.parametrize("extra", [["--decoder-first-pipeline-num-layers", "2"],
                                   ["--decoder-last-pipeline-num-layers", "2"]])
def test_one_of_them_at_pp2_with_vpp_is_estimated(extra):
    # one middle stage remains: 2 layers on each stage, one per chunk
    layout = layout_from_flags(BASE + extra, world_size=2)
    assert layout.virtual_pipeline_model_parallel_size == 2


def test_megatron_core_itself_divides_by_zero_there():
    tl = pytest.importorskip("megatron.core.transformer.transformer_layer")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, pipeline_model_parallel_size=2,
                            virtual_pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2,
                            num_layers_in_last_pipeline_stage=2, pipeline_dtype=torch.bfloat16)
    assert tl.get_transformer_layer_offset(cfg, vp_stage=0, pp_rank=0) == 0
    with pytest.raises(ZeroDivisionError):
        tl.get_transformer_layer_offset(cfg, vp_stage=0, pp_rank=1)
