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
    bucket = a.int_arg("ddp_bucket_size")
    if a.get("bridge_comm_overlap_ddp") and dist_opt:
        overlap_grad, overlap_param, bucket = _bridge_dp_overlap(a, dp, overlap_grad, overlap_param, bucket)
    if overlap_param and not (dist_opt or kw["optimizer"] == "dist_muon"):   # validate_args: or dist_muon
        a.fail("overlap_param_gather", "needs --use-distributed-optimizer")
    if overlap_param and not overlap_grad and not a.get("bridge_config"):
        # validate_args' rule; Megatron-Bridge 0.6.2 (no validate_args) and megatron-core's DDP do not assert it, and
        # CommOverlapConfig itself leaves the pair so when comm_overlap.overlap_grad_reduce is false at DP > 1
        a.fail("overlap_param_gather", "needs --overlap-grad-reduce")
    graph = a.bool_arg("optimizer_cuda_graph", False)
    if graph and ctx.version < Version("0.17"):
        # optimizer/optimizer_cuda_graph.py (OptimizerCudaGraphWrapper): in the 0.17.1 wheel, not in 0.16.1's
        a.fail("optimizer_cuda_graph", "needs megatron-core 0.17")
    if graph and a.bool_arg("optimizer_cpu_offload", False):
        _graph_of_offloaded_step(a)
    rs_fp32, patterns = _fp32_accumulation(a, kw, ctx, dist_opt, instances, frozen)
    return dict(use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=instances,
                overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param, ddp_bucket_size=bucket,
                freeze_all_layers=frozen, optimizer_cuda_graph=graph,
                ddp_reduce_scatter_with_fp32_accumulation=rs_fp32,
                ddp_param_name_patterns_for_fp32_local_accumulation=patterns)


def _bridge_dp_overlap(a: Args, dp: int, grad: bool, param: bool, bucket: int | None) -> tuple[bool, bool, int | None]:
    """A Megatron-Bridge config with a ``comm_overlap`` section and the distributed optimizer: CommOverlapConfig.setup
    (training/comm_overlap.py _get_optimizer_overlap_cfgs, Bridge 0.6.2) overwrites the DDP config's overlapped
    gradient reduce and parameter gather with DP > 1, and its bucket size with 128 Mi elements (DP > 1) or None,
    except where the comm_overlap section itself sets them (the reader gave those with a ``comm_overlap.`` key)."""
    auto = {"overlap_grad_reduce": dp > 1, "overlap_param_gather": dp > 1,
            "ddp_bucket_size": 128 * 1024 * 1024 if dp > 1 else None}
    mine = {"overlap_grad_reduce": grad, "overlap_param_gather": param, "ddp_bucket_size": bucket}
    out = {}
    for dest, value in mine.items():
        if a.key(dest).startswith("comm_overlap."):
            out[dest] = value
            continue
        out[dest] = auto[dest]
        if a.given(dest) and value != auto[dest]:
            a.notes.append(f"{a.key(dest)} = {value}: Megatron-Bridge's CommOverlapConfig.setup sets it to "
                           f"{auto[dest]} (data-parallel size {dp}); estimated with {auto[dest]}")
    return out["overlap_grad_reduce"], out["overlap_param_gather"], out["ddp_bucket_size"]


def _graph_of_offloaded_step(a: Args) -> None:
    """--optimizer-cuda-graph with --optimizer-cpu-offload (core 0.17.1, 0.18.2 and 0.19.2 alike).

    OptimizerCudaGraphWrapper captures HybridDeviceOptimizer.step (optimizer/cpu_offloading/hybrid_optimizer.py).
    With any part of the shard on the host the step waits on its D2H copies (``d2h_event.synchronize()``,
    an event recorded in the capturing stream: CUDA refuses it) and runs the CPU optimizer, host work that a
    replay would not repeat: the run fails at the capture. With --optimizer-offload-fraction 0 no parameter
    leaves (``offload_params_numel < offload_threshold`` is never true) and the step is the GPU optimizer's: its
    fp32 gradient copies (``grad.to(fp32_param.dtype)``) stay in the graph's pool (optimizer_graph_pool)."""
    raw = a.get("optimizer_offload_fraction")
    try:
        fraction = 1.0 if raw is None else float(raw)
    except (TypeError, ValueError):
        return                      # the optimizer offload section names the bad value
    if fraction > 0:
        a.fail("optimizer_cuda_graph", "cannot capture the CPU-offloaded optimizer step: HybridDeviceOptimizer.step "
               "synchronizes on its D2H copies and steps on the host (hybrid_optimizer.py), which a CUDA graph can "
               "neither capture nor replay; drop one of the flags or set --optimizer-offload-fraction 0")
        return
    a.notes.append(f"{a.key('optimizer_cuda_graph')}: with --optimizer-offload-fraction 0 the hybrid optimizer "
                   "steps on the GPU only; its GPU Adam is built without capturable=True (optimizer/__init__.py), "
                   "which only the plain Adam gets: memory is counted as for a graphed GPU step")


# memguard's bounds on --ddp-param-name-patterns-for-fp32-local-accumulation: Megatron's uses name a few modules
# ('*router*'); fnmatch's translation is quadratic in a pattern's '[' characters.
MAX_FP32_PATTERNS = 100
MAX_FP32_PATTERN_CHARS = 200


def _fp32_accumulation(a: Args, kw: Mapping[str, Any], ctx: Context, dist_opt: bool, instances: int,
                       frozen: bool) -> tuple[bool, tuple[str, ...]]:
    """DDP's fp32 gradient options (megatron/core/distributed/param_and_grad_buffer.py), which only DDP's
    _ParamAndGradBuffer reads: Megatron-FSDP and torch FSDP2 have their own gradient buffers.

    --ddp-reduce-scatter-with-fp32-accumulation (core 0.16.1 and 0.19.2): the distributed optimizer's
    reduce-scatter becomes an all-to-all into a temporary of the bucket's size and an fp32 sum of the rank's shard
    (reduce_scatter_with_fp32_accumulation.py); without the distributed optimizer gradients are all-reduced as
    before. _ParamAndGradBucketGroup asserts one optimizer instance.

    --ddp-param-name-patterns-for-fp32-local-accumulation (core 0.17 and later): each matching parameter's
    main_grad becomes an fp32 tensor of its own next to its (16-bit) slot in the gradient buffer;
    DistributedDataParallelConfig.__post_init__ asserts grad_reduce_in_fp32 is off."""
    fsdp = bool(kw.get("use_megatron_fsdp") or kw.get("use_torch_fsdp2"))
    rs_fp32 = a.bool_arg("ddp_reduce_scatter_with_fp32_accumulation", False)
    if rs_fp32:
        key = a.key("ddp_reduce_scatter_with_fp32_accumulation")
        if instances > 1:
            a.fail("ddp_reduce_scatter_with_fp32_accumulation", "is not supported with "
                   "--num-distributed-optimizer-instances > 1 (_ParamAndGradBucketGroup asserts it)")
        if fsdp:
            a.notes.append(f"{key}: not used by FSDP (DDP's buffers only)")
            rs_fp32 = False
        elif not dist_opt or frozen:
            a.notes.append(f"{key}: without the distributed optimizer the gradients are all-reduced (no effect)")
            rs_fp32 = False
    raw = a.get("ddp_param_name_patterns_for_fp32_local_accumulation")
    if raw in (None, "", [], ()):
        return rs_fp32, ()
    key = a.key("ddp_param_name_patterns_for_fp32_local_accumulation")
    given = raw
    if isinstance(raw, str):
        # a flag's value (nargs='+': the reader keeps a list) or a YAML string: space-separated patterns
        raw = raw.split()
    if not raw or not isinstance(raw, (list, tuple)) or not all(isinstance(p, str) and p for p in raw):
        # (a string of blanks splits into no pattern at all)
        a.fail("ddp_param_name_patterns_for_fp32_local_accumulation", f"must be fnmatch patterns, got {str(given)[:60]!r}")
        return rs_fp32, ()
    patterns = tuple(raw)
    if len(patterns) > MAX_FP32_PATTERNS or max(map(len, patterns)) > MAX_FP32_PATTERN_CHARS:
        a.fail("ddp_param_name_patterns_for_fp32_local_accumulation",
               f"takes at most {MAX_FP32_PATTERNS} patterns of at most {MAX_FP32_PATTERN_CHARS} characters (memguard's "
               f"bound: each is compiled and tested against every parameter name), got {len(patterns):,} of up to "
               f"{max(map(len, patterns)):,}")
        return rs_fp32, ()
    if ctx.version < Version("0.17"):
        a.fail("ddp_param_name_patterns_for_fp32_local_accumulation", "needs megatron-core 0.17")
        return rs_fp32, ()
    if fsdp:
        a.notes.append(f"{key}: not used by FSDP (DDP's buffers only)")
        return rs_fp32, ()
    if kw.get("accumulate_allreduce_grads_in_fp32"):
        a.fail("ddp_param_name_patterns_for_fp32_local_accumulation", "needs 16-bit gradients: "
               "DistributedDataParallelConfig asserts grad_reduce_in_fp32 is off (with --bf16: --grad-reduce-in-bf16, "
               "or --main-grads-dtype bf16 with --use-precision-aware-optimizer)")
        return rs_fp32, ()
    if frozen:
        return rs_fp32, ()
    return rs_fp32, patterns
