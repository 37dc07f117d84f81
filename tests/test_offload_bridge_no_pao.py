"""Megatron-Bridge's optimizer CPU offload without ``optimizer.use_precision_aware_optimizer``.

Bridge 0.6.2 runs no Megatron-LM validate_args and starts with it; megatron-core (0.16.1 and 0.19.2 alike)
leaves ``OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8`` False, so the distributed optimizer
keeps its fp32 main shards (distrib_optimizer.py ``shard_main_param = shard_model_param.clone().float()``)
and hands them to the HybridDeviceOptimizer (``_build_model_and_main_param_groups``, then
``HybridDeviceOptimizer(params=[g["orig_group"] ...])``); only the offloaded part's Adam state leaves the GPU
(hybrid_optimizer.py ``_get_sub_optimizer_param_groups``).

Model (test_readers_bridge.SHAPE): 4 layers, hidden 512, ffn 1536 (SwiGLU), 8 heads, 2 query groups, vocab 32000
untied, RMSNorm, no bias, TP 2, 8 ranks (DP 4). Parameters per TP rank, by hand:
  per layer: (qkv 512 x (512 + 2 x 2 x 64) + proj 512 x 512 + fc1 512 x 3072 + fc2 1536 x 512) / 2 + 2 norms x 512
             = (393,216 + 262,144 + 1,572,864 + 786,432) / 2 + 1,024 = 1,508,352
  4 layers 6,033,408 + embedding 32,000 x 512 / 2 + output layer 8,192,000 + final norm 512 = 22,417,920
  distributed-optimizer shard over DP 4: 5,604,480 elements.
"""
import os
import sys
import textwrap

import pytest

from megatron_memguard.errors import NotModelledError
from megatron_memguard.estimator.core import estimate
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.resolve import resolve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_readers_bridge import FLAT  # noqa: E402

SHARD = (4 * 1_508_352 + 2 * 32_000 * 512 // 2 + 512) // 4
assert SHARD == 5_604_480


def _layout(tmp_path, optimizer_extra: str, ddp_distopt: bool = True):
    text = FLAT.replace("bf16: true}\nddp", "bf16: true" + optimizer_extra + "}\nddp")
    if not ddp_distopt:
        text = text.replace("ddp: {use_distributed_optimizer: true", "ddp: {use_distributed_optimizer: false")
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    return resolve(read_config_file(str(p), overrides=[], model=None), world_size=8, megatron_version="0.19.2")


def _terms(L):
    s = estimate(L).stages[-1]
    return {t.name: t.bytes for t in s.terms}, {t.name: t.bytes for t in s.host_terms}


OFFLOAD = ", optimizer_cpu_offload: true, optimizer_offload_fraction: 0.5"


def test_fp32_main_shards_stay_and_half_the_state_moves(tmp_path):
    L = _layout(tmp_path, OFFLOAD)
    assert L.optimizer_cpu_offload and not L.use_precision_aware_optimizer
    assert any("optimizer.use_precision_aware_optimizer the distributed optimizer keeps" in n for n in L.notes)
    gpu, host = _terms(L)
    # the distributed optimizer's fp32 main shard of every shard element stays on the GPU
    assert gpu["main_parameters"] == 4 * SHARD
    # Adam's fp32 moments only for the half kept on the GPU (5,604,480 / 2 = 2,802,240 elements)
    assert gpu["adam_exp_avg"] == gpu["adam_exp_avg_sq"] == 4 * SHARD // 2
    # grad_reduce_in_fp32: the main shards' .grad is a view of the fp32 gradient buffer, no copy
    assert "main_grad_copies" not in gpu
    # host: fp32 master 4 + Adam 8 + fp32 gradient 4 bytes per offloaded element
    assert host == {"host_main_parameters": 4 * SHARD // 2, "host_optimizer_states": 8 * SHARD // 2,
                    "host_gradients": 4 * SHARD // 2}


def test_against_the_precision_aware_path_and_no_offload(tmp_path):
    off, _ = _terms(_layout(tmp_path, OFFLOAD))
    pao, _ = _terms(_layout(tmp_path, OFFLOAD + ", use_precision_aware_optimizer: true"))
    plain, _ = _terms(_layout(tmp_path, ""))
    # precision-aware: the hybrid optimizer's fp32 clones of the GPU half only
    assert pao["main_parameters"] == 4 * SHARD // 2
    assert off["main_parameters"] == plain["main_parameters"] == 4 * SHARD
    assert plain["adam_exp_avg"] == 4 * SHARD and off["adam_exp_avg"] == pao["adam_exp_avg"] == 4 * SHARD // 2


def test_without_the_distributed_optimizer_it_stays_refused(tmp_path):
    with pytest.raises(NotModelledError, match=r"^optimizer\.optimizer_cpu_offload: optimizer CPU offload without "
                                               r"optimizer\.use_precision_aware_optimizer under the non-distributed"):
        _layout(tmp_path, OFFLOAD, ddp_distopt=False)


def test_under_megatron_fsdp_it_stays_refused(tmp_path):
    # Megatron-FSDP's main weights are its own buffers, not the distributed optimizer's fp32 main shards
    text = FLAT.replace("bf16: true}\nddp", "bf16: true" + OFFLOAD + "}\nddp").replace(
        "overlap_grad_reduce: true}", "overlap_grad_reduce: true, use_megatron_fsdp: true, "
        "data_parallel_sharding_strategy: optim_grads_params}")
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    with pytest.raises(NotModelledError, match=r"^optimizer\.optimizer_cpu_offload: .* under Megatron-FSDP"):
        resolve(read_config_file(str(p), overrides=[], model=None), world_size=8, megatron_version="0.19.2")
