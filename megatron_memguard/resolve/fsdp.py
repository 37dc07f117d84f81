"""Section: Megatron-FSDP, torch FSDP2 and optimizer CPU offload (validate_args; megatron-core 0.16.1
and 0.19.2 megatron/training/arguments.py, mcore_fsdp_adapter.py, optimizer/__init__.py).

``fsdp`` runs before the optimizer section: Megatron-FSDP switches the distributed optimizer on in
0.18 and later (``args.use_distributed_optimizer = True`` with a warning), and the optimizer section's rules
(``--overlap-param-gather``, ``--use-precision-aware-optimizer``) then see it on, as in Megatron.
``optimizer_offload`` runs after it.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import NotModelledError
from ..estimator.fsdp import (FSDP_DEFAULTS_SINCE, GRAD_REDUCE_FP32_MAIN_GRADS_UNTIL, MAX_POOL_DOUBLE_BUFFER_SINCE,
                             MIXED_PRECISION_POLICY_SINCE, STRATEGIES, default_sharding_strategy)
from .args import Args, Context

OFF: dict[str, Any] = dict(
    use_megatron_fsdp=False, use_torch_fsdp2=False, data_parallel_sharding_strategy=None, fsdp_double_buffer=False,
    suggested_communication_unit_size=None, megatron_fsdp_main_params_dtype="fp32",
    megatron_fsdp_main_grads_dtype="auto", torch_fsdp2_reshard_after_forward=True,
    optimizer_cpu_offload=False, optimizer_offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=False,
    pin_cpu_grads=True, outer_dp_sharding_strategy="no_shard", keep_fp8_transpose_cache=False,
    log_params_norm=False, megatron_fsdp_cuda_graph_mode=False, megatron_fsdp_grad_comm_dtype="auto", nccl_ub=False,
    fsdp_all_gather_in_start_param_sync=True, fsdp_optimizer_states_at_start=False)

_FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")


def _fsdp_dtype(a: Args, dest: str, default: str) -> str:
    v = a.get(dest)
    if v is None:
        return default
    name = str(v).replace("torch.", "").strip().lower()
    name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "none": "auto"}.get(name, name)
    if name not in _FSDP_DTYPES:
        a.fail(dest, f"must be one of {', '.join(_FSDP_DTYPES)}, got {v!r}")
        return default
    return name


def fsdp(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    version = (ctx.version.major, ctx.version.minor)
    env = a.raw.env
    out = dict(OFF)
    custom = a.bool_arg("use_custom_fsdp", False)
    megatron = a.bool_arg("use_megatron_fsdp", False) or custom
    mkey = "use_megatron_fsdp" if a.given("use_megatron_fsdp") else "use_custom_fsdp"
    torch2 = a.bool_arg("use_torch_fsdp2", False)
    dist_opt = a.bool_arg("use_distributed_optimizer", False)
    new = version >= FSDP_DEFAULTS_SINCE          # the distributed-optimizer switch and optim_grads_params
    policy = version >= MIXED_PRECISION_POLICY_SINCE   # --megatron-fsdp-main-*-dtype, the ckpt-format assert
    if megatron and torch2:
        a.fail("use_torch_fsdp2", "cannot be combined with --use-megatron-fsdp (choose one FSDP)")
        return out
    if megatron or torch2:
        # (Megatron-FSDP asserts adam / sgd, and emerging optimizers refuse both FSDPs: resolve/muon.py)
        if megatron and (a.bool_arg("moe_single_grouped_weight", False) or a.bool_arg("moe_single_grouped_bias", False)):
            a.fail("moe_single_grouped_weight" if a.given("moe_single_grouped_weight") else "moe_single_grouped_bias",
                   "is not supported with Megatron-FSDP (validate_args)")
        if str(env.get("CUDA_DEVICE_MAX_CONNECTIONS", "")).strip() == "1":
            a.fail(mkey if megatron else "use_torch_fsdp2", "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset")
    nccl_ub = _nccl_ub(a, megatron, torch2)
    out["nccl_ub"] = nccl_ub
    if torch2:
        # validate_args, both versions
        if a.int_arg("pipeline_model_parallel_size", 1) != 1:
            a.fail("use_torch_fsdp2", "is not supported with pipeline parallelism (--pipeline-model-parallel-size 1)")
        if a.int_arg("expert_model_parallel_size", 1) != 1:
            a.fail("use_torch_fsdp2", "is not supported with expert parallelism")
        if dist_opt:
            a.fail("use_torch_fsdp2", "is not supported with --use-distributed-optimizer")
        if a.bool_arg("gradient_accumulation_fusion", True):
            a.fail("use_torch_fsdp2", "is not supported with gradient accumulation fusion",
                   "add --no-gradient-accumulation-fusion")
        if str(a.get("ckpt_format", "torch_dist")) not in ("torch_dist", "torch_dcp"):
            a.fail("ckpt_format", "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp")
        if not a.bool_arg("untie_embeddings_and_output_weights", False):
            a.fail("use_torch_fsdp2", "requires --untie-embeddings-and-output-weights")
        if a.bool_arg("fp16", False):
            a.fail("use_torch_fsdp2", "is not supported with --fp16")
        if a.bool_arg("fp8_param_gather", False):
            a.notes.append(f"{a.key('fp8_param_gather')}: turned off under --use-torch-fsdp2 (TE >= 2.0)")
        out.update(use_torch_fsdp2=True,
                   torch_fsdp2_reshard_after_forward=a.bool_arg("torch_fsdp2_reshard_after_forward", True))
    if megatron:
        strategy = str(a.get("data_parallel_sharding_strategy")
                       or default_sharding_strategy(f"{version[0]}.{version[1]}"))
        if strategy not in STRATEGIES:
            a.fail("data_parallel_sharding_strategy", f"must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
            strategy = "no_shard"
        if new:
            if not dist_opt:
                a.notes.append(f"{a.key(mkey)}: Megatron switches --use-distributed-optimizer on")
                a.a["use_distributed_optimizer"] = True    # as validate_args sets args.use_distributed_optimizer
            dist_opt = True
        elif not dist_opt:
            # core 0.16.1's validate_args does not switch it on (its examples pass it); without it
            # get_megatron_optimizer builds Float16OptimizerWithFloat16Params over FSDP's DTensor shards,
            # whose first step fails (model_param.main_grad: the DTensors have none; seen on the CPU referee)
            a.fail(mkey, f"needs --use-distributed-optimizer in megatron-core {version[0]}.{version[1]} (the non-distributed "
                         "optimizer fails on Megatron-FSDP's sharded parameters; 0.18 and later switch it on)",
                   "add --use-distributed-optimizer")
        if a.get("ckpt_format") is not None and str(a.get("ckpt_format")) != "fsdp_dtensor":
            a.fail("ckpt_format", "Megatron-FSDP requires --ckpt-format fsdp_dtensor")
        elif policy and a.get("ckpt_format") is None and a.key(mkey).startswith("--"):
            # core 0.17.1, 0.18.2 and 0.19.2 validate_args assert ckpt_format == "fsdp_dtensor" under --use-megatron-fsdp, and
            # the flag's default is torch_dist, so leaving it out fails too. Only for Megatron's own flags:
            # NeMo / Bridge configs carry their checkpoint format elsewhere (not read here).
            a.fail(mkey, f"requires --ckpt-format fsdp_dtensor in megatron-core {version[0]}.{version[1]} (the default torch_dist "
                         "is refused by validate_args)", "add --ckpt-format fsdp_dtensor")
        if strategy == "optim_grads_params" and a.get("check_weight_hash_across_dp_replicas_interval") is not None:
            a.fail("check_weight_hash_across_dp_replicas_interval", "is not supported with optim_grads_params")
        if a.bool_arg("init_model_with_meta_device", False) and strategy == "no_shard":
            a.fail("init_model_with_meta_device", "is not supported with --data-parallel-sharding-strategy no_shard")
        outer = str(a.get("outer_dp_sharding_strategy", "no_shard"))
        hsdp = a.int_arg("num_distributed_optimizer_instances", 1) > 1
        if outer not in ("no_shard", "optim"):
            a.fail("outer_dp_sharding_strategy", f"must be no_shard or optim, got {outer[:40]!r}")
            outer = "no_shard"
        elif hsdp and outer == "optim" and strategy != "optim_grads_params":
            # ParamAndGradBuffer._init_each_parameter_group_buffers (0.16.1 and 0.19.2)
            a.fail("outer_dp_sharding_strategy", "optim needs --data-parallel-sharding-strategy optim_grads_params")
        # HSDP (mcore_fsdp_adapter._init_dist_index, 0.16.1 and 0.19.2): FSDP shards over one replica's
        # partial DP x CP group and all-reduces the gradient shards in place across the replicas
        # (GradReducePipeline, outer no_shard): the FSDP terms with the group divided by the instances.
        # Outer "optim" (HFSDP): weights and gradients live in helper buffers sharded over the replica,
        # main weights and optimizer state are sharded over all of DP x CP (fsdp.py FsdpGroup.outer).
        # Without an outer group (one instance) the strategy has nothing to act on.
        out["outer_dp_sharding_strategy"] = outer if hsdp else "no_shard"
        if a.get("megatron_fsdp_version") not in (None, 1, "1"):
            # Megatron-LM main after core 0.19.2 (FullyShardedDataParallelV2, its own storage); neither
            # wheel memguard reads has it
            raise NotModelledError(a.key("megatron_fsdp_version"), "Megatron-FSDP version 2 (Megatron-LM main, "
                                                                   "not in megatron-core 0.16.1 or 0.19.2)")
        keep = a.bool_arg("keep_fp8_transpose_cache", False)
        recipe = str(a.get("fp8_recipe", "delayed"))
        if keep and a.get("fp8") and a.bool_arg("fp8_param_gather", False) and str(recipe) == "mxfp8":
            # mixed_precision.py fp8_discard_transpose_cache (0.16.1 and 0.19.2) drops a Float8Tensor's transpose
            # and a blockwise tensor's column-wise usage, and leaves an MXFP8Tensor alone: its column-wise data
            # live in Megatron-FSDP's transpose buffers, gathered and released by bucket whatever the flag
            a.notes.append(f"{a.key('keep_fp8_transpose_cache')}: no effect with the mxfp8 recipe (the column-wise "
                           "data live in Megatron-FSDP's own transpose buffers)")
        # without FP8 primary weights there are no Float8Tensor parameters whose transposes it keeps
        out["keep_fp8_transpose_cache"] = keep
        # --megatron-fsdp-enable-fine-grained-param-gather (0.19.2): every sub-module's pre-forward hook
        # gathers its own parameters' buckets, but the buckets are still the unit's groups and the unit's
        # _post_forward releases them: the same unit windows (megatron_fsdp.py _register_fsdp_hooks)
        a.bool_arg("megatron_fsdp_enable_fine_grained_param_gather", False)
        double = a.bool_arg("fsdp_double_buffer", False) or (
            version >= MAX_POOL_DOUBLE_BUFFER_SINCE and a.bool_arg("megatron_fsdp_max_pool_double_buffer", False)
        ) or nccl_ub
        out["megatron_fsdp_cuda_graph_mode"] = _gradient_modes(a, kw, new, version)
        unit = a.int_arg("suggested_communication_unit_size")
        # --log-params-norm: training.py calls calc_params_l2_norm after every step, and under Megatron-FSDP it
        # stops the model's communication first (stop_communication -> synchronize_param_gather ->
        # AllGatherPipeline.reset, megatron-core 0.19.2 training/utils/common_utils.py, megatron_fsdp.py), which
        # releases the unit buckets start_param_sync has just re-gathered: gone before Megatron logs memory
        out["log_params_norm"] = a.bool_arg("log_params_norm", False)
        # --load under Megatron-FSDP (ckpt-format fsdp_dtensor): load_checkpoint builds the optimizer's loading state
        # dict, for which Megatron-FSDP materialises the optimizer states with a dummy zero-gradient step
        # (DistributedOptimizer._init_optimizer_states_with_dummy_values when is_loading; skipped by --no-load-optim and
        # --finetune: megatron-core 0.19.2 training/checkpointing.py, optimizer/distrib_optimizer.py), whatever the
        # directory holds: the run's first micro-batch already has them (estimator/fsdp_layout.py)
        out["fsdp_optimizer_states_at_start"] = (megatron and a.given("load")
                                                 and not a.bool_arg("no_load_optim", False)
                                                 and not a.bool_arg("finetune", False))
        out.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, fsdp_double_buffer=double,
                   suggested_communication_unit_size=unit,
                   megatron_fsdp_main_params_dtype=_fsdp_dtype(a, "megatron_fsdp_main_params_dtype", "fp32"),
                   megatron_fsdp_main_grads_dtype=_fsdp_dtype(a, "megatron_fsdp_main_grads_dtype", "auto"))
        if not policy:
            a.notes.append(f"{a.key(mkey)}: megatron-core {version[0]}.{version[1]} keeps Megatron-FSDP's gradients "
                           "in fp32 under --accumulate-allreduce-grads-in-fp32 (0.17 and later: --megatron-fsdp-main-"
                           "grads-dtype, overridden to fp32 by that flag up to 0.18)")
        if not policy and (a.given("megatron_fsdp_main_params_dtype") or a.given("megatron_fsdp_main_grads_dtype")):
            a.notes.append(f"--megatron-fsdp-main-*-dtype: megatron-core {version[0]}.{version[1]} is read as 0.16.1, which has "
                           "no such flags; ignored")
            out.update(megatron_fsdp_main_params_dtype="fp32", megatron_fsdp_main_grads_dtype="auto")
        out["megatron_fsdp_grad_comm_dtype"] = _grad_comm_dtype(a, kw, out, policy, version, strategy, hsdp)
        if a.given("fsdp_all_gather_in_start_param_sync"):
            # (a DistributedDataParallelConfig field from core 0.17: megatron_fsdp.py start_param_sync gathers the
            # first bucket and its prefetch only when it is on; no Megatron flag, Bridge / NeMo 2 ddp key)
            gather = a.bool_arg("fsdp_all_gather_in_start_param_sync", True)
            if not gather and version < (0, 17):
                a.fail("fsdp_all_gather_in_start_param_sync", f"needs megatron-core 0.17 (DistributedDataParallelConfig "
                                                              f"of {version[0]}.{version[1]} has no such field)")
            out["fsdp_all_gather_in_start_param_sync"] = gather
    return out


def _nccl_ub(a: Args, megatron: bool, torch2: bool) -> bool:
    """--use-nccl-ub (DistributedDataParallelConfig.nccl_ub; core 0.16.1 and 0.19.2). The buffers come from a
    torch.cuda.MemPool over ncclMemAlloc (core/nccl_allocator.py), a private pool of the CUDA caching allocator
    (torch 2.14 torch/cuda/memory.py MemPool), which still counts them (memory_allocated / memory_reserved), in
    segments of their own. Megatron-FSDP always takes its double buffers
    then (megatron_fsdp ParamAndGradBuffer.__init__ sets ddp_config.fsdp_double_buffer, 0.16.1 and 0.19.2; 0.19.2's
    validate_args too), whose persistent pools hold the units' all-gather and reduce-scatter buckets; DDP's
    param_data / grad_data keep their sizes and padding (param_and_grad_buffer.py _ParamAndGradBuffer)."""
    if not a.bool_arg("nccl_ub", False):
        return False
    key = a.key("nccl_ub")
    if torch2:
        # get_megatron_ddp_config builds a TorchFullyShardedDataParallelConfig, which has no nccl_ub
        a.notes.append(f"{key}: not used by torch FSDP2 (its config has no user-buffer pool)")
        return False
    if megatron:
        a.notes.append(f"{key}: Megatron-FSDP's buffers come from an NCCL memory pool and its double buffers "
                       "(fsdp_double_buffers) are on; ncclMemAlloc's rounding of each segment to the cuMem "
                       "granularity (platform dependent) is not counted")
    else:
        a.notes.append(f"{key}: DDP's parameter and gradient buffers come from an NCCL memory pool (same bytes, "
                       "their own segments); ncclMemAlloc's rounding to the cuMem granularity (platform dependent) is "
                       "not counted")
    return True


def _grad_comm_dtype(a: Args, kw: Mapping[str, Any], out: Mapping[str, Any], policy: bool, version: tuple[int, int],
                     strategy: str, hsdp: bool) -> str:
    """--megatron-fsdp-grad-comm-dtype (MixedPrecisionPolicy.grad_comm_dtype, core 0.17.1, 0.18.2 and 0.19.2; "auto" =
    the main gradients' dtype). 0.17.1 and 0.18.2 take fp32 under --accumulate-allreduce-grads-in-fp32 whatever the
    flag says (mcore_fsdp_adapter.py, "grandfathered"), and bf16 under --grad-reduce-in-bf16 (validate_args). Under a sharded gradient buffer (optim_grads, optim_grads_params) the full buckets the
    backward accumulates into and reduce-scatters are fetched in it (megatron_fsdp param_and_grad_buffer.py
    GradReducePipeline: ``gbuf.fetch_bucket(dtype=grad_comm_dtype)``; the double buffers' main_grad_alloc is sized
    in it): modelled (estimator/fsdp.py bucket_grad_bytes). Unsharded gradients (no_shard, optim) and HSDP's outer
    reduction allocate an extra bucket in it at each reduction (allocate_bucket_storage, hsdp_comm_gbuf): named in
    a note, not counted."""
    dtype = _fsdp_dtype(a, "megatron_fsdp_grad_comm_dtype", "auto")
    key = a.key("megatron_fsdp_grad_comm_dtype")
    if policy and version < GRAD_REDUCE_FP32_MAIN_GRADS_UNTIL:
        if kw.get("accumulate_allreduce_grads_in_fp32"):
            if dtype != "auto":
                a.notes.append(f"{key}: megatron-core {version[0]}.{version[1]} communicates gradients in fp32 under "
                               "--accumulate-allreduce-grads-in-fp32 (the main gradients' dtype there); ignored")
            return "auto"
        if kw.get("grad_reduce_in_bf16"):
            dtype = "bf16"     # validate_args: args.megatron_fsdp_grad_comm_dtype = torch.bfloat16
    if dtype == "auto":
        return "auto"
    if not policy:
        a.notes.append(f"{key}: megatron-core {version[0]}.{version[1]} is read as 0.16.1, whose Megatron-FSDP has no "
                       "gradient communication dtype; ignored")
        return "auto"
    grads = out["megatron_fsdp_main_grads_dtype"]
    if dtype == (str(kw.get("params_dtype", "bf16")) if grads in ("auto", None) else grads):
        return dtype                       # "No additional memory is allocated when grad_comm_dtype == main_grads_dtype"
    if strategy == "optim" or (strategy == "no_shard" and a.bool_arg("overlap_grad_reduce", False)):
        # (no_shard without --overlap-grad-reduce all-reduces the gradient buffer itself: all_reduce_gradients)
        a.notes.append(f"{key}: with unsharded gradients ({strategy}) each reduction copies its bucket into a "
                       f"{dtype} buffer, kept in the reduce queue to the end of the backward; not counted")
    if hsdp:
        a.notes.append(f"{key}: HSDP's reduction across replicas copies each gradient bucket into a {dtype} "
                       "buffer (hsdp_comm_gbuf), not counted")
    return dtype


# DistributedDataParallelConfig.megatron_fsdp_cuda_graph_mode / megatron_fsdp_use_decoupled_grad: fields of the
# megatron-core 0.18.2 and 0.19.2 wheels (not 0.17.1's), the era of FSDP_DEFAULTS_SINCE
def _gradient_modes(a: Args, kw: Mapping[str, Any], new: bool, version: tuple[int, int]) -> bool:
    """Megatron-FSDP's gradient modes; returns whether the CUDA-graph-safe mode is on.

    megatron_fsdp_use_decoupled_grad: Megatron's command line sets it to --use-precision-aware-optimizer
    (training.py get_megatron_ddp_config, 0.18.2 and 0.19.2), Bridge turns it on with the precision-aware
    optimizer (config.py _validate_and_apply_megatron_fsdp_configs, Bridge 0.6.2). It must match: only the
    precision-aware optimizer reads ``.decoupled_grad`` (core/optimizer/__init__.py), and it reads nothing else.
    The estimate follows the optimizer (estimator/fsdp.py FsdpSpec: no cast copy with it).

    megatron_fsdp_cuda_graph_mode: zero_grad leaves the optimizer's gradient references in place (megatron_fsdp
    param_and_grad_buffer.py zero_grad, 0.19.2), so update_main_grads' cast copy of the gradient shard (when
    the main weights' dtype differs from the gradients' and the optimizer is not precision-aware) lives through
    the next forward and backward. Megatron's command line turns it on whenever CUDA graphs are
    (--cuda-graph-impl other than none: the cuda graphs section); a Bridge / NeMo 2 config only when it says so."""
    pao = bool(kw.get("use_precision_aware_optimizer"))
    ver = f"{version[0]}.{version[1]}"
    for dest in ("megatron_fsdp_use_decoupled_grad", "megatron_fsdp_cuda_graph_mode"):
        if a.given(dest) and a.bool_arg(dest, False) and not new:
            a.fail(dest, f"needs megatron-core 0.18 (DistributedDataParallelConfig of {ver} has no such field)")
    if a.given("megatron_fsdp_use_decoupled_grad"):
        decoupled = a.bool_arg("megatron_fsdp_use_decoupled_grad", False)
        if decoupled and not pao:
            a.fail("megatron_fsdp_use_decoupled_grad", "needs the precision-aware optimizer "
                   "(use_precision_aware_optimizer): only it reads the decoupled gradients Megatron-FSDP installs")
        elif not decoupled and pao and new:
            a.notes.append(f"{a.key('megatron_fsdp_use_decoupled_grad')}: false is turned on with the precision-aware "
                           "optimizer (Megatron-LM and Bridge set it from use_precision_aware_optimizer)")
    return new and a.given("megatron_fsdp_cuda_graph_mode") and a.bool_arg("megatron_fsdp_cuda_graph_mode", False)


def optimizer_offload(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """validate_args (both versions): --optimizer-cpu-offload needs --use-precision-aware-optimizer,
    and with --fp8-param-gather the delayed recipe."""
    if not a.bool_arg("optimizer_cpu_offload", False):
        return {}
    if not kw.get("use_precision_aware_optimizer"):
        key = a.key("optimizer_cpu_offload")
        if not key.startswith("optimizer."):
            a.fail("optimizer_cpu_offload", "needs --use-precision-aware-optimizer")
        elif kw.get("use_distributed_optimizer") and not (kw.get("use_megatron_fsdp") or kw.get("use_torch_fsdp2")):
            # Megatron-Bridge (0.6.2 ConfigContainer.validate / runtime_config_update) runs no validate_args and takes
            # it: megatron-core's get_megatron_optimizer (0.16.1 and 0.19.2) builds the HybridDeviceOptimizer anyway,
            # OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8 stays False, so the distributed optimizer
            # keeps its fp32 main shards and gradient copies on the GPU and hands those to the hybrid optimizer
            # (distrib_optimizer.py): estimator/offload_optimizer.py, only the optimizer state moves
            pao = key[:-len("optimizer_cpu_offload")] + "use_precision_aware_optimizer"   # the config's own key
            a.notes.append(f"{key}: without {pao} the distributed optimizer keeps its "
                           "fp32 main shards (and gradient copies) of the whole shard on the GPU under the hybrid "
                           "optimizer; only the offloaded part's optimizer state (and its pinned fp32 host masters) "
                           "leave it")
        else:
            # without the distributed optimizer Float16OptimizerWithFloat16Params swaps its fp32 main params into the
            # hybrid optimizer's groups after it built its sub-optimizers over the 16-bit ones (optimizer.py), and
            # under FSDP the main weights are FSDP's: neither path is sized
            what = "torch FSDP2" if kw.get("use_torch_fsdp2") else "Megatron-FSDP" if kw.get("use_megatron_fsdp") \
                else "the non-distributed optimizer"
            raise NotModelledError(key, "optimizer CPU offload without optimizer.use_precision_aware_optimizer under "
                                   f"{what} (Megatron-Bridge accepts it; memguard sizes it only with the distributed "
                                   "optimizer's fp32 main shards)",
                                   "set optimizer.use_precision_aware_optimizer=true, or use the distributed optimizer")
    if a.bool_arg("fp8_param_gather", False) and str(a.get("fp8_recipe", "delayed")) != "delayed":
        a.fail("optimizer_cpu_offload", "with --fp8-param-gather needs --fp8-recipe delayed")
    fraction = a.float_arg("optimizer_offload_fraction", 1.0)
    if not 0.0 <= fraction <= 1.0:
        a.fail("optimizer_offload_fraction", f"must be between 0 and 1, got {fraction}")
        fraction = 1.0
    if kw.get("use_megatron_fsdp") or kw.get("use_torch_fsdp2"):
        fsdp = "Megatron-FSDP" if kw.get("use_megatron_fsdp") else "torch FSDP2"
        if fraction > 0:
            # HybridDeviceOptimizer._get_sub_optimizer_param_groups (hybrid_optimizer.py, core 0.16.1 and 0.19.2)
            # moves the first parameters to the host as param.detach().clone().cpu().pin_memory(); under FSDP the
            # optimizer's parameters are DTensors (Megatron-FSDP: make_fsdp_dtensor for every sharding strategy;
            # FSDP2: fully_shard), and torch 2.13 / 2.14 has no DTensor rule for it ("NYI: aten._pin_memory.default",
            # reproduced on a CPU mesh): the optimizer cannot be built
            a.fail("optimizer_cpu_offload", f"cannot be used with {fsdp}: the hybrid optimizer pins a host copy of each "
                                            "offloaded parameter, and FSDP's DTensor parameters cannot be pinned "
                                            "(torch: NYI aten._pin_memory)")
        elif kw.get("use_megatron_fsdp") and kw.get("megatron_fsdp_main_params_dtype", "fp32") == "fp32":
            # Fraction 0 keeps every parameter on the GPU, and HybridDeviceOptimizer (hybrid_optimizer.py, core 0.16.1
            # and 0.19.2) makes an fp32 clone only of non-fp32 parameters; only such clones get a gradient, read as
            # getattr(param, "decoupled_grad", param.grad). Megatron-FSDP's fp32 main weights go to the GPU sub-optimizer
            # as they are: TE FusedAdam built with use_decoupled_grad=False (optimizer/__init__.py passes no such
            # flag) reads p.grad and skips p.grad None (fused_adam.py, TE 2.20.2). Under the precision-aware optimizer,
            # which offload requires, Megatron-FSDP installs the gradient in param.decoupled_grad and leaves .grad None
            # (param_and_grad_buffer.py update_main_grads: 0.16.1 use_precision_aware_optimizer, 0.19.2
            # megatron_fsdp_use_decoupled_grad, set from it by training.py): no weight is ever updated
            a.fail("optimizer_cpu_offload", f"with Megatron-FSDP's fp32 main weights and {a.key('optimizer_offload_fraction')} 0 "
                                            "updates nothing: the hybrid optimizer's GPU Adam reads .grad, Megatron-FSDP "
                                            "puts the gradients in .decoupled_grad under "
                                            f"{a.key('use_precision_aware_optimizer')}")
        else:
            # nothing leaves the GPU: the hybrid optimizer gives non-fp32 weights an fp32 clone (its gradient read
            # from decoupled_grad / grad), Adam states and fp32 gradient copies on the GPU; torch FSDP2's parameter
            # dtypes and a non-fp32 --megatron-fsdp-main-params-dtype are not read here
            raise NotModelledError(a.key("optimizer_offload_fraction"),
                                   f"--optimizer-cpu-offload with offload fraction 0 under {fsdp}"
                                   + (" with non-fp32 main weights" if kw.get("use_megatron_fsdp") else "")
                                   + " (the hybrid optimizer's fp32 clones of FSDP's weights on the GPU)")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                overlap_cpu_optimizer_d2h_h2d=a.bool_arg("overlap_cpu_optimizer_d2h_h2d", False),
                pin_cpu_grads=a.bool_arg("pin_cpu_grads", True))
