"""How training runs the model: batch, pipeline split, optimizer with DDP, recomputation."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    # the evaluation step's micro-batch (--eval-micro-batch-size, megatron.training 0.18+): its forward-only peak is
    # a second figure of the estimate (estimator/eval_step.py); None: no evaluation step estimated
    eval_micro_batch_size: int | None = None
    # its number of micro-batches (evaluate(): eval_global_batch_size / (eval micro-batch x DP)); None with no figure
    eval_num_microbatches: int | None = None


@dataclass(frozen=True)
class PipelineSplit:
    """Which layers each pipeline stage builds and how the schedule interleaves them."""

    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool
    pipeline_model_parallel_layout: str | None
    microbatch_group_size_per_vp_stage: int | None
    overlap_p2p_comm: bool


@dataclass(frozen=True)
class Optimizer:
    """The optimizer and megatron's DDP wrapper (buffers, buckets); the state dtypes are in Precision."""

    optimizer: str                  # adam | sgd | muon | adaptive_muon | dist_muon | lion | soap
    use_distributed_optimizer: bool
    store_param_remainders: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    ddp_bucket_size: int | None
    ddp_pad_buckets_for_high_nccl_busbw: bool
    muon_scalar_optimizer: str = "adam"   # with a Muon-family optimizer: what updates the non-matrix params
    # how a Muon-family step orthogonalises (estimator/muon.py step_working_set; OptimizerConfig defaults)
    muon_split_qkv: bool = True
    muon_tp_mode: str = "blockwise"             # blockwise | duplicated | distributed
    muon_fp32_matmul_prec: str = "medium"       # medium: Newton-Schulz in bf16 | high | highest
    muon_nesterov: bool = False
    # Megatron-FSDP / torch FSDP2 instead of DDP's buffers (estimator/fsdp.py; off by default)
    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    data_parallel_sharding_strategy: str | None = None   # no_shard | optim | optim_grads | optim_grads_params
    fsdp_double_buffer: bool = False
    suggested_communication_unit_size: int | None = None
    megatron_fsdp_main_params_dtype: str = "fp32"        # fp32 | bf16 | fp16 | auto (no main weights)
    megatron_fsdp_main_grads_dtype: str = "auto"         # auto = the parameter dtype (core 0.19)
    torch_fsdp2_reshard_after_forward: bool = True
    # HSDP (--num-distributed-optimizer-instances > 1): "optim" also shards the optimizer state across replicas
    outer_dp_sharding_strategy: str = "no_shard"
    # --keep-fp8-transpose-cache: Megatron-FSDP keeps each FP8 primary weight's transpose after use
    keep_fp8_transpose_cache: bool = False
    # --log-params-norm, read under Megatron-FSDP only: the training loop's params norm releases the unit
    # buckets start_param_sync re-gathered after the step before Megatron logs memory (estimator/fsdp_layout.py)
    log_params_norm: bool = False
    # Megatron-FSDP's CUDA-graph-safe mode (DistributedDataParallelConfig.megatron_fsdp_cuda_graph_mode, core 0.18+):
    # zero_grad keeps the optimizer's gradient references, so a cast copy of the gradient shard persists
    megatron_fsdp_cuda_graph_mode: bool = False
    # --megatron-fsdp-grad-comm-dtype (core 0.18+): the full gradient buckets' dtype under sharded gradients
    megatron_fsdp_grad_comm_dtype: str = "auto"
    # DistributedDataParallelConfig.fsdp_all_gather_in_start_param_sync (core 0.17+): False = no all-gather after the step
    fsdp_all_gather_in_start_param_sync: bool = True
    # Megatron-FSDP with --load (fsdp_dtensor): the optimizer states exist before the first forward (a dummy step while
    # building the loading state dict, even from an empty directory), so the run's first micro-batch has them too
    fsdp_optimizer_states_at_start: bool = False
    # --use-nccl-ub: DDP / Megatron-FSDP buffers from an NCCL memory pool (Megatron-FSDP: double buffers on)
    nccl_ub: bool = False
    # --ddp-reduce-scatter-with-fp32-accumulation: the all-to-all reduce-scatter's temporaries (estimator/ddp_extras.py)
    ddp_reduce_scatter_with_fp32_accumulation: bool = False
    # --ddp-param-name-patterns-for-fp32-local-accumulation (core 0.17+): fp32 main_grad copies of matching parameters
    ddp_param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = ()
    # optimizer CPU offload (estimator/offload_optimizer.py; off by default)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    # --freeze-all-layers: no parameter requires grad (no DDP buffers, no optimizer state)
    freeze_all_layers: bool = False
    # --optimizer-cuda-graph (core 0.19): the step captured into a CUDA graph's private pool
    optimizer_cuda_graph: bool = False


@dataclass(frozen=True)
class Recompute:
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: tuple[str, ...]
    distribute_saved_activations: bool
    # activation offloading to the host, the other way to take saved activations off the GPU
    cpu_offloading_num_layers: int = 0
    fine_grained_activation_offloading: bool = False
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1024 * 1024
    # fine-grained offloading's core 0.19 tuning (estimator/offload_activations.py)
    activation_offload_fraction: float = 1.0
    delta_offload_bytes_across_pp_ranks: int = 0
    delay_offload_until_cuda_graph: bool = False
    fine_grained_offloading_max_inflight_offloads: int | None = None
