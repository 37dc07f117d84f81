"""Section: the optimizer and the DDP buffers (validate_args, OptimizerConfig, DistributedDataParallelConfig)."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import NotModelledError
from .args import Args, Context


def _frozen(a: Args, kw: Mapping[str, Any]) -> bool:
    """--freeze-all-layers: get_model sets requires_grad False on every parameter (training.py, core 0.19.2), so
    DDP builds no buffer and the optimizer gets no parameter; validate_args turns the distributed optimizer and
    the overlapped param gather off (with a warning)."""
    if not a.bool_arg("freeze_all_layers", False):
        return False
    if kw["optimizer"] not in ("adam", "sgd"):
        raise NotModelledError(a.key("freeze_all_layers"), f"frozen layers with the {kw['optimizer']} optimizer")
    for dest in ("use_megatron_fsdp", "use_torch_fsdp2", "optimizer_cpu_offload"):
        if a.bool_arg(dest, False):
            raise NotModelledError(a.key("freeze_all_layers"), f"frozen layers with {a.key(dest)}")
    for dest in ("use_distributed_optimizer", "overlap_param_gather"):
        if a.bool_arg(dest, False):
            a.notes.append(f"{a.key('freeze_all_layers')}: {a.key(dest)} turned off, as validate_args does")
    a.notes.append(f"{a.key('freeze_all_layers')}: no gradients and no optimizer state; the first pipeline stage "
                   "saves no activations, later stages are counted as in training (they save what their input "
                   "gradients need, less than that: the estimate errs high there)")
    return True


def optimizer(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    dp, cp = kw["data_parallel_size"], kw["context_parallel_size"]
    frozen = _frozen(a, kw)
    dist_opt = a.bool_arg("use_distributed_optimizer", False) and not frozen
    if kw["optimizer"] not in ("adam", "sgd") and a.bool_arg("use_layer_wise_distributed_optimizer", False):
        # a live core 0.19 namespace after validate_args: --use-distributed-optimizer (or dist_muon) with an emerging
        # optimizer became use_layer_wise_distributed_optimizer, use_distributed_optimizer False (arguments.py)
        dist_opt = not frozen
    instances = a.int_arg("num_distributed_optimizer_instances", 1)
    if instances > 1 and not dist_opt:
        a.fail("num_distributed_optimizer_instances", "needs --use-distributed-optimizer")
    if instances > 1 and (dp * cp) % instances:
        a.fail("num_distributed_optimizer_instances", f"{instances} must divide DP*CP = {dp * cp}")
    if kw["use_precision_aware_optimizer"] and not dist_opt:
        # OptimizerConfig.__post_init__ asserts it (megatron-core 0.16.1 and 0.19.2 alike).
        a.fail("use_precision_aware_optimizer", "needs --use-distributed-optimizer")
    overlap_grad = a.bool_arg("overlap_grad_reduce", False)
    overlap_param = a.bool_arg("overlap_param_gather", False) and not frozen
    if overlap_param and not (dist_opt or kw["optimizer"] == "dist_muon"):   # validate_args: or dist_muon
        a.fail("overlap_param_gather", "needs --use-distributed-optimizer")
    if overlap_param and not overlap_grad:
        a.fail("overlap_param_gather", "needs --overlap-grad-reduce")
    bucket = a.int_arg("ddp_bucket_size")
    graph = a.bool_arg("optimizer_cuda_graph", False)
    if graph and ctx.version < Version("0.17"):
        # optimizer/optimizer_cuda_graph.py (OptimizerCudaGraphWrapper): in the 0.17.1 wheel, not in 0.16.1's
        a.fail("optimizer_cuda_graph", "needs megatron-core 0.17")
    if graph and a.bool_arg("optimizer_cpu_offload", False):
        raise NotModelledError(a.key("optimizer_cuda_graph"), "a CUDA graph of the CPU-offloaded optimizer step")
    return dict(use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=instances,
                overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param, ddp_bucket_size=bucket,
                freeze_all_layers=frozen, optimizer_cuda_graph=graph)
