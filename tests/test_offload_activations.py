"""Activation offloading, hand-computed from TE's cpu_offload.py (the (L - N) * T_layer bound it documents)
and megatron/core/pipeline_parallel/fine_grained_activation_offload.py (core 0.19.2)."""
import pytest

from megatron_memguard.estimator.offload_activations import (fine_grained_plan, group_bytes, layer_offload_host_bytes,
                                                              layer_offload_removed, layer_offload_resident_layers)


def test_layer_level():
    assert layer_offload_resident_layers(32, 8) == 24
    assert layer_offload_removed(32, 8, per_layer_saved=100) == 800
    assert layer_offload_host_bytes(8, per_layer_saved=100) == 800
    with pytest.raises(ValueError):
        layer_offload_resident_layers(32, 32)     # TransformerConfig: 0 <= N < num_layers


def test_min_tensor_size():
    # tensors below --min-offloaded-tensor-size elements (default 1,048,576) stay on the GPU
    tensors = {"attn_norm": [(1024 * 1024, 2)], "core_attn": [(4 * 1024 * 1024, 2), (1000, 4)]}
    assert group_bytes(tensors, ("attn_norm", "core_attn", "mlp_norm")) == {
        "attn_norm": 2 * 1024 * 1024, "core_attn": 8 * 1024 * 1024, "mlp_norm": 0}


def test_plan_last_stage_keeps_last_group():
    groups = {"mlp_norm": 30, "attn_norm": 10, "core_attn": 50}
    last = fine_grained_plan(groups, layers=4, last_stage=True)
    # forward order attn_norm, core_attn, mlp_norm: the last layer's mlp_norm group stays
    assert last.offloaded == 4 * 90 - 30 and last.kept_last_group == 30
    assert last.staging == 2 * 50
    mid = fine_grained_plan(groups, layers=4, last_stage=False)
    assert mid.offloaded == 360 and mid.host_bytes == 360
