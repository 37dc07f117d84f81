"""The chosen layout as something to paste: Megatron flags, NeMo 2 and Megatron-Bridge overrides.

Key names follow shared/reference/nemo-bridge.md: NeMo 2 recipes take parallelism under
``trainer.strategy`` (DDP settings under ``trainer.strategy.ddp``), batch and sequence under
``data``, recomputation under ``model.config`` and the distributed optimizer under ``optim.config``;
Megatron-Bridge's ConfigContainer takes the TransformerConfig fields under ``model``, batch sizes
under ``train``, DDP settings under ``ddp`` and ``optimizer`` (it ORs the two
``use_distributed_optimizer`` keys, both are written).
"""
from __future__ import annotations

from ..layout import Layout


def _b(v: bool) -> str:
    return "true" if v else "false"


def megatron_flags(L: Layout, experts: tuple[int, int] | None = None) -> list[str]:
    """``experts``: (EP, ETP) of a mixture-of-experts layout, written out whenever the model has experts."""
    f = [f"--tensor-model-parallel-size {L.tp}", f"--pipeline-model-parallel-size {L.pp}"]
    if experts is not None:
        f += [f"--expert-model-parallel-size {experts[0]}", f"--expert-tensor-parallel-size {experts[1]}"]
    if L.vpp > 1:
        f.append(f"--num-virtual-stages-per-pipeline-rank {L.vpp}")
    if L.decoder_first_pipeline_num_layers is not None:
        f.append(f"--decoder-first-pipeline-num-layers {L.decoder_first_pipeline_num_layers}")
    if L.decoder_last_pipeline_num_layers is not None:
        f.append(f"--decoder-last-pipeline-num-layers {L.decoder_last_pipeline_num_layers}")
    f.append(f"--context-parallel-size {L.cp}")
    if L.sequence_parallel:
        f.append("--sequence-parallel")
    f += [f"--micro-batch-size {L.micro_batch_size}", f"--global-batch-size {L.global_batch_size}",
          f"--seq-length {L.seq_length}"]
    if L.use_distributed_optimizer:
        f.append("--use-distributed-optimizer")
    if L.overlap_grad_reduce:
        f.append("--overlap-grad-reduce")
    if L.overlap_param_gather:
        f.append("--overlap-param-gather")
    if L.recompute_granularity == "selective":
        f.append("--recompute-granularity selective")
    elif L.recompute_granularity == "full":
        f += ["--recompute-granularity full", f"--recompute-method {L.recompute_method}",
              f"--recompute-num-layers {L.recompute_num_layers}"]
    return f


def _parallel(prefix: str, L: Layout, experts: tuple[int, int] | None = None) -> list[str]:
    """The parallel sizes and the pipeline split: NeMo 2's strategy and Bridge's model config share the names."""
    o = [f"{prefix}tensor_model_parallel_size={L.tp}", f"{prefix}pipeline_model_parallel_size={L.pp}",
         f"{prefix}virtual_pipeline_model_parallel_size={L.vpp if L.vpp > 1 else 'null'}",
         f"{prefix}context_parallel_size={L.cp}", f"{prefix}sequence_parallel={_b(L.sequence_parallel)}"]
    if experts is not None:
        o += [f"{prefix}expert_model_parallel_size={experts[0]}", f"{prefix}expert_tensor_parallel_size={experts[1]}"]
    if L.decoder_first_pipeline_num_layers is not None:
        o.append(f"{prefix}num_layers_in_first_pipeline_stage={L.decoder_first_pipeline_num_layers}")
    if L.decoder_last_pipeline_num_layers is not None:
        o.append(f"{prefix}num_layers_in_last_pipeline_stage={L.decoder_last_pipeline_num_layers}")
    return o


def _recompute(prefix: str, L: Layout) -> list[str]:
    o = [f"{prefix}recompute_granularity={L.recompute_granularity or 'null'}"]
    if L.recompute_granularity == "full":
        o += [f"{prefix}recompute_method={L.recompute_method}", f"{prefix}recompute_num_layers={L.recompute_num_layers}"]
    return o


def nemo2_overrides(L: Layout, gpus_per_node: int | None = None, experts: tuple[int, int] | None = None) -> list[str]:
    s = "trainer.strategy."
    o = _parallel(s, L, experts)
    o += [f"data.micro_batch_size={L.micro_batch_size}", f"data.global_batch_size={L.global_batch_size}",
          f"data.seq_length={L.seq_length}",
          f"optim.config.use_distributed_optimizer={_b(L.use_distributed_optimizer)}",
          f"{s}ddp.overlap_grad_reduce={_b(L.overlap_grad_reduce)}",
          f"{s}ddp.overlap_param_gather={_b(L.overlap_param_gather)}"]
    o += _recompute("model.config.", L)
    if gpus_per_node:
        nodes = -(-L.world_size // gpus_per_node)
        o += [f"trainer.devices={min(gpus_per_node, L.world_size)}", f"trainer.num_nodes={nodes}"]
    return o


def bridge_overrides(L: Layout, experts: tuple[int, int] | None = None) -> list[str]:
    o = _parallel("model.", L, experts)
    o += [f"model.seq_length={L.seq_length}", f"dataset.seq_length={L.seq_length}",
          f"train.micro_batch_size={L.micro_batch_size}", f"train.global_batch_size={L.global_batch_size}",
          f"ddp.use_distributed_optimizer={_b(L.use_distributed_optimizer)}",
          f"optimizer.use_distributed_optimizer={_b(L.use_distributed_optimizer)}",
          f"ddp.overlap_grad_reduce={_b(L.overlap_grad_reduce)}",
          f"ddp.overlap_param_gather={_b(L.overlap_param_gather)}"]
    return o + _recompute("model.", L)
