"""Section: the optimizer and the DDP buffers (validate_args, OptimizerConfig, DistributedDataParallelConfig)."""
from __future__ import annotations

from typing import Any, Mapping

from .args import Args, Context


def optimizer(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    dp, cp = kw["data_parallel_size"], kw["context_parallel_size"]
    dist_opt = a.bool_arg("use_distributed_optimizer", False)
    instances = a.int_arg("num_distributed_optimizer_instances", 1)
    if instances > 1 and not dist_opt:
        a.fail("num_distributed_optimizer_instances", "needs --use-distributed-optimizer")
    if instances > 1 and (dp * cp) % instances:
        a.fail("num_distributed_optimizer_instances", f"{instances} must divide DP*CP = {dp * cp}")
    if kw["use_precision_aware_optimizer"] and not dist_opt:
        # OptimizerConfig.__post_init__ asserts it (megatron-core 0.16.1 and 0.19.2 alike).
        a.fail("use_precision_aware_optimizer", "needs --use-distributed-optimizer")
    overlap_grad = a.bool_arg("overlap_grad_reduce", False)
    overlap_param = a.bool_arg("overlap_param_gather", False)
    if overlap_param and not (dist_opt or kw["optimizer"] == "dist_muon"):   # validate_args: or dist_muon
        a.fail("overlap_param_gather", "needs --use-distributed-optimizer")
    if overlap_param and not overlap_grad:
        a.fail("overlap_param_gather", "needs --overlap-grad-reduce")
    bucket = a.int_arg("ddp_bucket_size")
    return dict(use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=instances,
                overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param, ddp_bucket_size=bucket)
