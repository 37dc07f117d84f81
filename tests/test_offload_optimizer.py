"""Optimizer CPU offload: GPU and host bytes per rank, by hand from the source lines they follow.

Sources (identical in megatron-core 0.16.1 and 0.19.2): optimizer/__init__.py (HybridDeviceOptimizer
with ``param_update_in_fp32=True``; 0.19.2 l.502-541), optimizer/cpu_offloading/hybrid_optimizer.py
``_get_sub_optimizer_param_groups`` (l.251-300: offload while ``offload_params_numel <
offload_threshold``; pinned clone, ``.float()`` master) and ``_set_sub_optimizer_grads`` (l.83-115:
``fp32_param.grad = grad.to(fp32)`` on the GPU part, fp32 host grads pinned by ``pin_cpu_grads``).
"""
from __future__ import annotations

import pytest

from megatron_memguard.estimator import offload_optimizer as O


def test_half_offloaded_adam_fp32_grads():
    s = O.OffloadSpec.from_flat(optimizer_offload_fraction=0.5, grad_bytes=4)
    b = O.offload_bytes(s, shard_numel=1000)
    # GPU: fp32 clone + 2 fp32 Adam states of the 500 elements kept; the fp32 grad buffer is viewed
    assert (b.gpu_main_params, b.gpu_states, b.gpu_grad_copy) == (2000, (2000, 2000), 0)
    # host: fp32 master 4 + Adam 8 + fp32 grad 4 per element moved
    assert (b.host_main_params, b.host_states, b.host_grads) == (2000, 4000, 2000)
    assert b.host_total == 500 * 16
    assert b.host_pinned == 2000          # only the grads; .float() of a pinned tensor is pageable


def test_full_offload_leaves_nothing_of_the_optimizer_on_the_gpu():
    b = O.offload_bytes(O.OffloadSpec.from_flat(), shard_numel=1000)   # CLI default fraction 1.0
    assert b.gpu_total == 0 and b.gpu_grad_copy == 0
    assert b.host_total == 16_000


def test_bf16_grads_are_cast_on_the_gpu_part():
    s = O.OffloadSpec.from_flat(optimizer_offload_fraction=0.25, grad_bytes=2)
    b = O.offload_bytes(s, shard_numel=1000)
    assert b.gpu_grad_copy == 4 * 750


def test_no_pin_and_sgd():
    s = O.OffloadSpec.from_flat(optimizer="sgd", pin_cpu_grads=False)
    b = O.offload_bytes(s, shard_numel=100)
    assert b.host_states == 400 and b.host_pinned == 0


def test_offloaded_numel_overshoots_by_at_most_one_shard():
    # threshold 0.5 x 1000 = 500: 300 (< 500, go on), 600 (>= 500, stop)
    assert O.offloaded_numel(0.5, [300, 300, 400]) == 600
    assert O.offloaded_numel(0.0, [300, 300, 400]) == 0
    assert O.offloaded_numel(1.0, [300, 300, 400]) == 1000


def test_per_node():
    assert O.host_bytes_per_node([10, 20], gpus_per_node=8) == 160
    assert O.host_bytes_per_node([1, 2, 3, 4], gpus_per_node=2) == 7


def test_bad_fraction():
    with pytest.raises(ValueError, match="optimizer_offload_fraction"):
        O.OffloadSpec.from_flat(optimizer_offload_fraction=1.5)


def test_without_the_precision_aware_optimizer_only_the_state_moves():
    # Bridge's path (OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8 False, core 0.16.1 / 0.19.2):
    # the hybrid optimizer gets the distributed optimizer's fp32 main shards (distrib_optimizer.py
    # shard_main_param = shard_model_param.clone().float()), so param_update_in_fp32 clones nothing on the GPU and
    # casts no gradient (``param.dtype != torch.float32`` is False); the host master is the pinned fp32 clone itself
    s = O.OffloadSpec.from_flat(optimizer_offload_fraction=0.5, grad_bytes=2, use_precision_aware_optimizer=False)
    b = O.offload_bytes(s, shard_numel=1000)
    assert (b.gpu_main_params, b.gpu_states, b.gpu_grad_copy) == (0, (2000, 2000), 0)
    assert (b.host_main_params, b.host_states, b.host_grads) == (2000, 4000, 2000)
    assert b.host_pinned == 2000 + 2000   # pinned fp32 masters + pinned grads
