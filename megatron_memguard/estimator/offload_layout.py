"""Optimizer CPU offload for a resolved layout: the optimizer terms that replace the distributed
optimizer's on the GPU, and the host terms. Bytes come from ``offload_optimizer.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .offload_optimizer import OffloadBytes, OffloadSpec, offload_bytes
from .result import Term

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def offload_enabled(L: Any) -> bool:
    return bool(getattr(L, "optimizer_cpu_offload", False))


def offload_spec(L: Any) -> OffloadSpec:
    # The DDP gradient buffer: bf16 with --use-precision-aware-optimizer --main-grads-dtype bf16,
    # else fp32 under fp32 accumulation, else the parameter dtype (as states.py counts it).
    g = 2 if (L.use_precision_aware_optimizer and L.main_grads_dtype == "bf16") else (
        4 if L.accumulate_allreduce_grads_in_fp32 else DTYPE_BYTES[L.params_dtype])
    return OffloadSpec.from_flat(optimizer_offload_fraction=getattr(L, "optimizer_offload_fraction", 1.0),
                                 optimizer=L.optimizer, params_dtype=L.params_dtype, grad_bytes=g,
                                 pin_cpu_grads=bool(getattr(L, "pin_cpu_grads", True)),
                                 overlap_cpu_optimizer_d2h_h2d=bool(getattr(L, "overlap_cpu_optimizer_d2h_h2d", False)),
                                 use_precision_aware_optimizer=bool(L.use_precision_aware_optimizer))


@dataclass(frozen=True)
class OffloadTerms:
    state_terms: tuple[Term, ...]   # replace main_parameters / adam_* / sgd_momentum
    step_terms: tuple[Term, ...]    # replace main_grad_copies
    host_terms: tuple[Term, ...]
    bytes: OffloadBytes
    replaced: frozenset[str]        # the distributed optimizer's terms these replace


# The distributed optimizer's terms the hybrid optimizer's replace.
OFFLOAD_REPLACED = frozenset({"main_parameters", "adam_exp_avg", "adam_exp_avg_sq", "sgd_momentum", "main_grad_copies"})
# Without the precision-aware optimizer its fp32 main shards and gradient copies stay (offload_optimizer.py):
# only the optimizer state moves.
OFFLOAD_REPLACED_STATES = frozenset({"adam_exp_avg", "adam_exp_avg_sq", "sgd_momentum"})


def offload_shard_numel(L: Any, st: Any) -> int:
    """Elements of the rank's distributed-optimizer shard, from its StageStates (the first moment
    covers every shard element once)."""
    per = DTYPE_BYTES[L.exp_avg_dtype] if L.optimizer == "adam" else 4
    return st.exp_avg_bytes // per


def offload_terms(L: Any, shard_numel: int) -> OffloadTerms:
    """Terms of a rank whose distributed-optimizer shard has ``shard_numel`` elements."""
    spec = offload_spec(L)
    b = offload_bytes(spec, shard_numel)
    f = f"{spec.fraction:g} of {shard_numel:,} shard elements on the host"
    st = []
    if b.gpu_main_params:
        st.append(Term("main_parameters", b.gpu_main_params, "optimizer",
                       detail=f"fp32 clones of the {b.gpu_numel:,} shard elements kept on the GPU ({f})"))
    names = ("adam_exp_avg", "adam_exp_avg_sq") if L.optimizer == "adam" else ("sgd_momentum",)
    for name, v in zip(names, b.gpu_states):
        if not v:
            continue          # everything offloaded: no GPU-side state
        st.append(Term(name, v, "optimizer", detail=f"fp32 state of the {b.gpu_numel:,} GPU-side elements ({f})"))
    step = ()
    if b.gpu_grad_copy:
        step = (Term("main_grad_copies", b.gpu_grad_copy, "optimizer",
                     detail="fp32 copies of the GPU-side 16-bit gradients at the step"),)
    host = []
    if b.host_total:
        pinned = "page-locked" if spec.pin_cpu_grads else "pageable"
        where = "" if spec.precision_aware else "; their GPU fp32 main shards stay"
        host = [Term("host_main_parameters", b.host_main_params, "host", "host",
                     f"fp32 masters of {b.offloaded_numel:,} offloaded elements{where}"),
                Term("host_optimizer_states", b.host_states, "host", "host",
                     f"{L.optimizer} state of the offloaded elements"),
                Term("host_gradients", b.host_grads, "host", "host", f"fp32 gradient copies ({pinned})")]
    return OffloadTerms(tuple(st), step, tuple(host), b,
                        OFFLOAD_REPLACED if spec.precision_aware else OFFLOAD_REPLACED_STATES)
