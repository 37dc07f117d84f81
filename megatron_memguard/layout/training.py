"""How training runs the model: batch, pipeline split, optimizer with DDP, recomputation."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int


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

    optimizer: str                  # adam | sgd | muon | adaptive_muon | dist_muon
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
    # optimizer CPU offload (estimator/offload_optimizer.py; off by default)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True


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
