"""Megatron-FSDP and optimizer-offload keys of Bridge and NeMo 2 configs reach Megatron's args names.

megatron-core dataclass defaults that differ from Megatron's CLI (both versions read):
DistributedDataParallelConfig.data_parallel_sharding_strategy = 'no_shard' (distributed_data_parallel_
config.py; the CLI default is optim_grads_params in 0.19.2) and OptimizerConfig.optimizer_offload_fraction
= 0.0 (optimizer_config.py; the CLI default is 1.0)."""
import os
import sys
import textwrap

import pytest

from megatron_memguard.readers.detect import read_config_file

from test_readers_bridge import FLAT

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.shared_data import CONFIGS  # noqa: E402

NEMO2 = os.path.join(CONFIGS, "nemo2", "context_model.yaml")


def read(tmp_path, text, name="run_config.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return read_config_file(str(p), overrides=[], model=None)


def test_bridge_fsdp_keys(tmp_path):
    text = FLAT.replace("ddp: {use_distributed_optimizer: true, grad_reduce_in_fp32: true, overlap_grad_reduce: true}",
                        "ddp: {use_distributed_optimizer: true, grad_reduce_in_fp32: true, overlap_grad_reduce: true, "
                        "use_megatron_fsdp: true, data_parallel_sharding_strategy: optim_grads, fsdp_double_buffer: true, "
                        "suggested_communication_unit_size: 40000000, megatron_fsdp_main_grads_dtype: torch.float32}")
    text = text.replace("optimizer: {optimizer: adam, use_distributed_optimizer: false, bf16: true}",
                        "optimizer: {optimizer: adam, use_distributed_optimizer: false, bf16: true, "
                        "optimizer_cpu_offload: true, optimizer_offload_fraction: 0.5, overlap_cpu_optimizer_d2h_h2d: true}")
    raw = read(tmp_path, text)
    a = raw.args
    assert a["use_megatron_fsdp"] is True and a["data_parallel_sharding_strategy"] == "optim_grads"
    assert a["fsdp_double_buffer"] is True and a["suggested_communication_unit_size"] == 40_000_000
    assert a["megatron_fsdp_main_grads_dtype"] == "fp32"
    assert raw.origin["data_parallel_sharding_strategy"] == "ddp.data_parallel_sharding_strategy"
    assert a["optimizer_offload_fraction"] == 0.5 and a["overlap_cpu_optimizer_d2h_h2d"] is True


def test_bridge_dataclass_defaults_when_keys_are_absent(tmp_path):
    text = FLAT.replace("overlap_grad_reduce: true}", "overlap_grad_reduce: true, use_megatron_fsdp: true}")
    text = text.replace("bf16: true}\nddp", "bf16: true, optimizer_cpu_offload: true}\nddp")
    raw = read(tmp_path, text)
    assert raw.args["data_parallel_sharding_strategy"] == "no_shard"
    assert "DistributedDataParallelConfig default" in raw.origin["data_parallel_sharding_strategy"]
    assert raw.args["optimizer_offload_fraction"] == 0.0


def test_nemo2_fsdp_and_offload_keys(tmp_path):
    text = open(NEMO2).read()
    assert "  config:\n    _target_: megatron.core.optimizer.optimizer_config.OptimizerConfig\n" in text
    text = text.replace("    optimizer: adam\n", "    optimizer: adam\n    optimizer_cpu_offload: true\n"
                        "    optimizer_offload_fraction: 0.25\n")
    text += textwrap.dedent("""
    trainer:
      devices: 8
      num_nodes: 1
      strategy:
        ddp:
          use_megatron_fsdp: true
          data_parallel_sharding_strategy: optim_grads_params
    """)
    p = tmp_path / "model.yaml"
    p.write_text(text)
    raw = read_config_file(str(p), overrides=[], model=None)
    assert raw.args["use_megatron_fsdp"] is True
    assert raw.args["data_parallel_sharding_strategy"] == "optim_grads_params"
    assert raw.origin["data_parallel_sharding_strategy"] == "trainer.strategy.ddp.data_parallel_sharding_strategy"
    assert raw.args["optimizer_offload_fraction"] == 0.25
    assert raw.origin["optimizer_offload_fraction"] == "optim.config.optimizer_offload_fraction"


def test_bridge_fsdp_offload_at_default_fraction_is_an_error(tmp_path):
    """Bridge 0.6.2: OptimizerConfig.optimizer_offload_fraction defaults to 0.0 and config.py sets
    ddp.megatron_fsdp_use_decoupled_grad under use_precision_aware_optimizer, so Megatron-FSDP fills only
    .decoupled_grad while the hybrid optimizer's GPU FusedAdam steps the fp32 main weights from .grad
    (hybrid_optimizer.py core 0.19.2; fused_adam.py TE 2.20.2): nothing would be updated. The error names
    Bridge's key."""
    from megatron_memguard import resolve
    from megatron_memguard.errors import ConfigError, ConfigErrors
    text = FLAT.replace("overlap_grad_reduce: true}", "overlap_grad_reduce: true, use_megatron_fsdp: true, "
                        "data_parallel_sharding_strategy: optim_grads_params}")
    text = text.replace("bf16: true}\nddp", "bf16: true, optimizer_cpu_offload: true, "
                        "use_precision_aware_optimizer: true}\nddp")
    with pytest.raises((ConfigError, ConfigErrors), match=r"optimizer\.optimizer_cpu_offload.*decoupled_grad"):
        resolve(read(tmp_path, text), world_size=8, megatron_version="0.19.2")
