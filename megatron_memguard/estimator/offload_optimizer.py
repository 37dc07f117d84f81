"""Optimizer CPU offload (``--optimizer-cpu-offload``): what leaves the GPU, what stays, and the host.

megatron/core/optimizer/__init__.py (core 0.16.1 and 0.19.2 alike) builds a
``HybridDeviceOptimizer`` (optimizer/cpu_offloading/hybrid_optimizer.py) over the distributed
optimizer's shard of each parameter, with ``param_update_in_fp32=True``. The distributed optimizer
treats it as precision-aware (``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` is forced True in
OptimizerConfig), so Megatron keeps no fp32 main shard of its own: the hybrid optimizer receives
the 16-bit shard views of the DDP parameter buffer.

``_get_sub_optimizer_param_groups`` walks those shards in order and moves the first ones, until
``offload_fraction`` x (their total size) is reached, to the host: a pinned 16-bit clone whose
``.float()`` copy (pageable) becomes the CPU master, updated by ``torch.optim.AdamW(fused=True)``
(or SGD) with its state on the host; ``_set_sub_optimizer_grads`` gives each CPU master an fp32
gradient buffer on the host (pinned unless ``--no-pin-cpu-grads``) on the first step. The other
shards stay on the GPU with an fp32 clone (the GPU master) and TE's FusedAdam state; at the step
their gradients are cast to fp32 (``fp32_param.grad = grad.to(fp32)``, no copy when the gradient
buffer is fp32 already). The DDP parameter and gradient buffers stay on the GPU whole; the
copies to and from the host go straight between those buffers and the host tensors (no GPU
staging buffer in the code). The hybrid optimizer is given fp32 states whatever
``--exp-avg-dtype`` says: it is not passed on.

Without the precision-aware optimizer (Megatron-Bridge takes ``optimizer_cpu_offload`` without it; Megatron-LM's
validate_args does not) ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` stays False: the distributed optimizer
keeps its own fp32 main shards (``shard_main_param = shard_model_param.clone().float()``) and fp32 gradient views or
copies (``_copy_model_grads_to_main_grads``: ``.grad = shard_model_grad.float()``) of the whole shard on the GPU,
and hands the fp32 main shards to the hybrid optimizer. Those are fp32 already, so the hybrid optimizer makes no
GPU clone and casts no gradient; the offloaded ones are cloned to the host as pinned fp32 tensors that are the CPU
masters themselves (no ``.float()`` copy), and the GPU main shard stays (the step copies the host master back
into it). Only the optimizer state of the offloaded part leaves the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class OffloadSpec:
    """What decides optimizer-offload memory, from Megatron's flat argument names."""

    fraction: float                 # --optimizer-offload-fraction (share of the shard on the host)
    state_bytes: tuple[int, ...]    # per element: Adam exp_avg, exp_avg_sq (fp32); SGD momentum
    params_dtype: str               # the model's parameters (the DDP param buffer)
    grad_bytes: int                 # the DDP gradient buffer per element (--main-grads-dtype / fp32 accumulation)
    pin_cpu_grads: bool = True      # --no-pin-cpu-grads
    overlap_d2h_h2d: bool = False   # --overlap-cpu-optimizer-d2h-h2d: one CPU optimizer per parameter
    precision_aware: bool = True    # use_precision_aware_optimizer (False: Bridge's path over fp32 main shards)
    notes: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_flat(cls, *, optimizer_offload_fraction: float = 1.0, optimizer: str = "adam",
                  params_dtype: str = "bf16", grad_bytes: int = 4, pin_cpu_grads: bool = True,
                  overlap_cpu_optimizer_d2h_h2d: bool = False,
                  use_torch_optimizer_for_cpu_offload: bool = False,
                  use_precision_aware_optimizer: bool = True) -> "OffloadSpec":
        """``optimizer_offload_fraction``: Megatron's CLI default is 1.0 (OptimizerConfig's own
        default, 0.0, applies only to configs built without the CLI)."""
        if not 0.0 <= float(optimizer_offload_fraction) <= 1.0:
            raise ValueError("optimizer_offload_fraction must be between 0 and 1")
        states = (4, 4) if optimizer == "adam" else (4,)
        # --use-torch-optimizer-for-cpu-offload changes which GPU class is named, but for Adam the
        # code overrides it with FusedAdam again; the bytes are the same either way.
        return cls(fraction=float(optimizer_offload_fraction), state_bytes=states, params_dtype=params_dtype,
                   grad_bytes=grad_bytes, pin_cpu_grads=pin_cpu_grads, overlap_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
                   precision_aware=bool(use_precision_aware_optimizer))


def offloaded_numel(fraction: float, shard_numels: list[int] | tuple[int, ...]) -> int:
    """Elements moved to the host: the shards in the optimizer's order while the running total is
    below ``fraction`` x their sum (``offload_params_numel < offload_threshold``), so the last one
    taken can overshoot the fraction by up to one shard."""
    threshold = sum(shard_numels) * fraction
    moved = 0
    for n in shard_numels:
        if moved >= threshold:
            break
        moved += n
    return moved


@dataclass(frozen=True)
class OffloadBytes:
    """One rank's optimizer memory under CPU offload, GPU and host apart, by named term."""

    gpu_main_params: int = 0     # offload_gpu_main_params: fp32 clones of the shards kept on the GPU
    gpu_states: tuple[int, ...] = ()  # offload_gpu_exp_avg / _exp_avg_sq: their optimizer state
    gpu_grad_copy: int = 0       # offload_gpu_grad_copies: fp32 gradients of the GPU part at the step
    host_main_params: int = 0    # host_main_params: fp32 masters on the host
    host_states: int = 0         # host_optimizer_states: optimizer state on the host
    host_grads: int = 0          # host_grads: fp32 gradient copies on the host
    host_pinned: int = 0         # of the host bytes, how many are page-locked
    offloaded_numel: int = 0
    gpu_numel: int = 0

    @property
    def gpu_total(self) -> int:
        return self.gpu_main_params + sum(self.gpu_states)

    @property
    def host_total(self) -> int:
        return self.host_main_params + self.host_states + self.host_grads


def offload_bytes(spec: OffloadSpec, shard_numel: int, moved: int | None = None) -> OffloadBytes:
    """Bytes of one rank whose distributed-optimizer shard has ``shard_numel`` elements.
    ``moved``: elements on the host when known from the shard list (``offloaded_numel``); by default
    ``fraction`` x ``shard_numel``."""
    cpu = int(round(spec.fraction * shard_numel)) if moved is None else min(moved, shard_numel)
    gpu = shard_numel - cpu
    # param_update_in_fp32: 16-bit shards get fp32 clones; fp32 shards are their own masters on the
    # GPU and, on the host, the pinned clone itself is the master. Without the precision-aware optimizer
    # every shard handed over is an fp32 main shard: the distributed optimizer's own main shards and
    # gradient copies (its terms, not these) stay whole on the GPU.
    fp32_params = spec.params_dtype == "fp32" or not spec.precision_aware
    gpu_main = 0 if fp32_params else 4 * gpu
    grad_copy = 4 * gpu if spec.grad_bytes != 4 and spec.precision_aware else 0
    host_main = 4 * cpu
    host_grads = 4 * cpu
    pinned = (host_grads if spec.pin_cpu_grads else 0) + (host_main if fp32_params else 0)
    return OffloadBytes(gpu_main_params=gpu_main, gpu_states=tuple(b * gpu for b in spec.state_bytes),
                        gpu_grad_copy=grad_copy, host_main_params=host_main,
                        host_states=sum(spec.state_bytes) * cpu, host_grads=host_grads, host_pinned=pinned,
                        offloaded_numel=cpu, gpu_numel=gpu)


def host_bytes_per_node(per_rank: list[int] | tuple[int, ...], gpus_per_node: int) -> int:
    """Host memory one node needs: the largest ``gpus_per_node`` per-rank figures summed (an upper
    bound when the node's ranks hold different pipeline stages)."""
    if gpus_per_node <= 0 or not per_rank:
        return 0
    top = sorted(per_rank, reverse=True)
    if len(top) >= gpus_per_node:
        return sum(top[:gpus_per_node])
    return top[0] * gpus_per_node
