"""Megatron-FSDP, torch FSDP2 and optimizer offload rules against megatron-core 0.19.2's real
parse_and_validate_args (megatron.training, Python 3.12 env): what Megatron accepts, memguard resolves
the same way; what Megatron's validate_args refuses, memguard refuses naming the flag."""
import os
import sys

import pytest

from conftest import CONTAINER_ERA, LLAMA31_8B, H100


pytestmark = CONTAINER_ERA
BASE = LLAMA31_8B + "--lr 1e-4 --train-iters 10 --mock-data --no-rope-fusion --micro-batch-size 1".split()
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


@pytest.fixture
def megatron(monkeypatch):
    import torch
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")      # FSDP asserts it is not 1
    for k, v in (("WORLD_SIZE", "8"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)

    def run(*flags):
        global_vars.unset_global_variables()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
        return parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    yield run
    global_vars.unset_global_variables()


def memguard(*flags):
    from megatron_memguard import layout_from_flags
    return layout_from_flags(BASE + list(flags), world_size=8, megatron_version="0.19.2")


def test_megatron_fsdp_defaults_read_back_from_megatrons_namespace(megatron):
    from megatron_memguard import estimate, resolve
    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    args = megatron(*FSDP)
    assert args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "optim_grads_params"
    L = resolve(raw_from_namespace(args), world_size=8)
    M = memguard(*FSDP)
    for f in ("use_megatron_fsdp", "data_parallel_sharding_strategy", "use_distributed_optimizer",
              "megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype"):
        assert getattr(L, f) == getattr(M, f), f
    names = {t.name for t in estimate(L).stages[0].terms}
    assert {"fsdp_parameters", "fsdp_gradients", "fsdp_non_unit_parameters"} <= names


@pytest.mark.parametrize("flags, key", [
    (["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--pipeline-model-parallel-size", "2"], "--use-torch-fsdp2"),
    (["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--use-distributed-optimizer"], "--use-torch-fsdp2"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2"),   # gradient accumulation fusion is on by default
    (["--use-megatron-fsdp", "--ckpt-format", "torch_dist"], "--ckpt-format"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
])
def test_what_megatron_refuses_memguard_refuses(megatron, flags, key):
    from megatron_memguard.errors import ConfigError, ConfigErrors
    with pytest.raises(AssertionError):
        megatron(*flags)
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        memguard(*flags)
    assert key in str(e.value)


def test_offload_and_torch_fsdp2_accepted_by_both(megatron):
    for flags in (["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                   "--optimizer-offload-fraction", "0.5"],
                  ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]):
        args = megatron(*flags)
        L = memguard(*flags)
        assert (L.optimizer_cpu_offload, L.use_torch_fsdp2) == (bool(args.optimizer_cpu_offload),
                                                                 bool(args.use_torch_fsdp2))
    assert args.optimizer_offload_fraction == 1.0 == memguard().optimizer_offload_fraction   # the CLI default


def test_moe_and_hsdp_under_megatron_fsdp_accepted_by_both(megatron):
    """Experts under Megatron-FSDP, with and without hybrid sharding (two optimizer instances): Megatron's
    validate_args accepts them and memguard resolves the same sharding groups (DP 8, expert DP 4)."""
    from megatron_memguard.layout import ShardGroup
    moe = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-grouped-gemm"]
    for extra in ([], ["--num-distributed-optimizer-instances", "2"]):
        args = megatron(*FSDP, *moe, *extra)
        L = memguard(*FSDP, *moe, *extra)
        assert args.use_megatron_fsdp and L.use_megatron_fsdp and L.moe is not None
        inst = args.num_distributed_optimizer_instances
        assert L.num_distributed_optimizer_instances == inst
        assert L.parallel.shard_size(ShardGroup.DENSE_DP) == 8 // inst
        assert L.parallel.shard_size(ShardGroup.EXPERT_DP) == 8 // (args.expert_tensor_parallel_size * 2) // inst


def test_hybrid_fsdp_with_outer_optimizer_sharding_accepted_by_both(megatron):
    from megatron_memguard.layout import ShardGroup
    flags = ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"]
    args = megatron(*FSDP, *flags)
    L = memguard(*FSDP, *flags)
    assert args.outer_dp_sharding_strategy == L.outer_dp_sharding_strategy == "optim"
    assert L.parallel.shard_size(ShardGroup.DENSE_DP) == 8 // args.num_distributed_optimizer_instances


@pytest.mark.parametrize("flags", [
    FSDP + ["--cuda-graph-impl", "local"],
    FSDP + ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
    FSDP + ["--use-nccl-ub", "--megatron-fsdp-grad-comm-dtype", "fp32"],
    FSDP + ["--use-precision-aware-optimizer", "--cuda-graph-impl", "transformer_engine"],
    ["--use-distributed-optimizer", "--ddp-reduce-scatter-with-fp32-accumulation", "--use-nccl-ub"],
    ["--grad-reduce-in-bf16", "--ddp-param-name-patterns-for-fp32-local-accumulation", "*norm*", "all"],
])
def test_the_ddp_config_megatron_builds_is_the_one_memguard_reads(megatron, flags):
    """training.py get_megatron_ddp_config (0.19.2) on the validated namespace: the CUDA-graph-safe mode, decoupled
    gradients, the double buffers --use-nccl-ub turns on, the gradient communication dtype and DDP's fp32 options
    are what the layout holds (DistributedDataParallelConfig.__post_init__ runs its asserts too)."""
    from megatron.training.training import get_megatron_ddp_config
    from megatron_memguard import resolve
    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    args = megatron(*flags)
    ddp = get_megatron_ddp_config(args)
    L = memguard(*flags)
    N = resolve(raw_from_namespace(args), world_size=8, megatron_version="0.19.2")   # the hook's reading
    for f in ("megatron_fsdp_cuda_graph_mode", "megatron_fsdp_grad_comm_dtype", "fsdp_all_gather_in_start_param_sync",
              "nccl_ub", "fsdp_double_buffer", "ddp_reduce_scatter_with_fp32_accumulation",
              "ddp_param_name_patterns_for_fp32_local_accumulation"):
        assert getattr(N, f) == getattr(L, f), f
    fsdp = bool(args.use_megatron_fsdp)
    assert L.megatron_fsdp_cuda_graph_mode == (fsdp and bool(ddp.megatron_fsdp_cuda_graph_mode))
    assert L.nccl_ub == bool(ddp.nccl_ub)
    if fsdp:
        # (0.18.2's DistributedDataParallelConfig leaves it off under nccl_ub; its ParamAndGradBuffer turns it on,
        # param_and_grad_buffer.py line 1671: "it always uses fsdp double buffer")
        assert L.fsdp_double_buffer == (bool(ddp.fsdp_double_buffer) or bool(ddp.nccl_ub))
        assert L.fsdp_all_gather_in_start_param_sync == bool(ddp.fsdp_all_gather_in_start_param_sync)
        assert bool(ddp.megatron_fsdp_use_decoupled_grad) == L.use_precision_aware_optimizer
        comm = ddp.megatron_fsdp_grad_comm_dtype
        assert L.megatron_fsdp_grad_comm_dtype == ("auto" if comm is None else {"torch.float32": "fp32"}[str(comm)])
    else:
        assert L.ddp_reduce_scatter_with_fp32_accumulation == bool(ddp.reduce_scatter_with_fp32_accumulation)
        assert L.ddp_param_name_patterns_for_fp32_local_accumulation == tuple(
            ddp.param_name_patterns_for_fp32_local_accumulation)
