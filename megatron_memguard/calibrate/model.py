"""Runs and observations for ``memguard calibrate``, and how each level's prediction depends on the site constants.

A run is one job: its resolved Layout, its GPU, and per logged rank what was measured (bytes):

* ``steady``: allocated memory between iterations, after the optimizer step (Megatron's ``allocated`` after
  K iterations, memguard's ``allocated``): model state and persistent buffers, no activations;
* ``peak_allocated`` / ``peak_reserved``: the caching allocator's peaks since the process started;
* ``device_used`` with the ``reserved`` of the same moment: device memory in use (NVML).

Levels (docs/calibrate.md): the *allocated* level fits the workspaces from ``steady`` (their only site-
dependent part: peaks also hold activations, which are modelled, never fitted); the *reserved* level fits
the allocator's slack from measured peak reserved / peak allocated; the *device* level fits the CUDA
context and NCCL's buffers from measured device used - reserved. Each level's constants enter its
prediction linearly; the coefficients are read off the estimator itself (two estimates per constant), so
they follow whatever the estimator counts (two cuBLAS handles, one TE workspace, the communicators in use).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Sequence

from ..estimator import estimate
from ..estimator.overheads import (CUBLAS_DEFAULT_BYTES, CUBLAS_HOPPER_BYTES, NCCL_DEFAULT_BUFFSIZE, _hopper_or_newer,
                                   nccl_buffsize, nccl_communicators, te_workspace_bytes)
from ..estimator.result import StageEstimate
from ..estimator.site import DEFAULT_SITE, SPEC, SiteConstants
from ..estimator.params import mtp_stack_runs
from ..gpus import GpuSpec
from ..layout import Layout
from ..partition import MLP_MOE
from ..units import MiB
from .fit import Row

LEVEL_CONSTANTS = {"allocated": ("cublas_workspace", "te_workspace"), "reserved": ("allocator_fragmentation",),
                   "device": ("cuda_context", "nccl_per_communicator")}
# what each level's prediction is compared with
LEVEL_METRIC = {"allocated": "steady", "reserved": "peak_reserved", "device": "device_used"}
METRICS = ("steady", "peak_allocated", "peak_reserved", "device_used")
METRIC_LABELS = {"steady": "allocated after the step", "peak_allocated": "peak allocated",
                 "peak_reserved": "peak reserved", "device_used": "device used"}


@dataclass(frozen=True)
class Observation:
    """What one rank of a run measured (bytes; None: not logged)."""

    rank: int
    pp_rank: int
    dp_rank: int = 0
    steady: int | None = None
    peak_allocated: int | None = None
    reserved: int | None = None          # reserved at the moment device_used was read
    peak_reserved: int | None = None
    device_used: int | None = None
    # the rank's position in the expert-data-parallel optimizer group (None: TP rank 0's of ``dp_rank``)
    expert_dp_rank: int | None = None


@dataclass
class CalibrationRun:
    name: str
    layout: Layout
    gpu: GpuSpec | None
    observations: list[Observation]
    device: str = "gpu"
    source: str = ""
    notes: list[str] = field(default_factory=list)
    # for the time constants (calibrate/timeruns.py): the run's configuration and Megatron's logged iteration times
    raw: Any = None
    iteration_times: list[tuple[int, float, float | None]] = field(default_factory=list)

    def has(self, metric: str) -> bool:
        return any(getattr(o, metric) is not None for o in self.observations)


def explicit(site: SiteConstants, gpu: GpuSpec | None) -> SiteConstants:
    """``site`` with the workspaces' GPU-generation defaults written out (the base of a fit)."""
    name = gpu.name if gpu else None
    return replace(site, cublas_workspace=site.cublas_workspace if site.cublas_workspace is not None else
                   (CUBLAS_HOPPER_BYTES if _hopper_or_newer(name) else CUBLAS_DEFAULT_BYTES),
                   te_workspace=te_workspace_bytes(name, site))


@lru_cache(maxsize=4096)
def _stage(L: Layout, gpu: GpuSpec | None, device: str, pp_rank: int, dp_rank: int, site: SiteConstants,
           expert_dp_rank: int | None = None) -> StageEstimate:
    return estimate(L, device=device, gpu=gpu, gpu_memory=gpu.memory_bytes if gpu else None, dp_rank=dp_rank,
                    site=site, expert_dp_rank=expert_dp_rank).stages[pp_rank]


def stage(run: CalibrationRun, o: Observation, site: SiteConstants) -> StageEstimate:
    dp = o.dp_rank if o.dp_rank < run.layout.dp_shard_size else 0
    edp = o.expert_dp_rank if run.layout.moe is not None and dp == o.dp_rank else None
    return _stage(run.layout, run.gpu, run.device, o.pp_rank, dp, site, edp)


def communicators(L: Layout, stage_has_moe: bool = True) -> float:
    """NCCL communicators of a rank, scaled by the job's NCCL_BUFFSIZE (the constant is per default buffer size).
    ``stage_has_moe`` False: the rank's pipeline stage holds no MoE layer (no expert-parallel communicators)."""
    buff = nccl_buffsize(L.env_dict.get("NCCL_BUFFSIZE"))
    scale = buff / NCCL_DEFAULT_BUFFSIZE if buff else 1.0
    return len(nccl_communicators(L, stage_has_moe)) * scale


def _stage_has_moe(run: CalibrationRun, o: Observation) -> bool:
    """Whether the observed rank's stage holds an MoE layer (decoder or MTP), as the estimator decides it."""
    L = run.layout
    if L.moe is None:
        return True
    st = stage(run, o, DEFAULT_SITE)
    return any(kind.mlp == MLP_MOE and n for c in st.chunks for kind, n in c.kind_runs) or (
        st.pp_rank == L.pp - 1 and bool(getattr(L, "mtp_num_layers", 0)) and any(kind.mlp == MLP_MOE for kind, _ in mtp_stack_runs(L)))


def _coefficients(run: CalibrationRun, o: Observation, site: SiteConstants, names: Sequence[str],
                  attr: str) -> tuple[float, list[float]]:
    """(value at ``site``, d value / d constant for each of ``names``) of a StageEstimate attribute."""
    base = getattr(stage(run, o, site), attr)
    out = []
    for n in names:
        step = MiB if getattr(site, n) + MiB <= SPEC[n].upper else -MiB
        bumped = replace(site, **{n: getattr(site, n) + step})
        out.append((getattr(stage(run, o, bumped), attr) - base) / step)
    return base, out


def allocated_rows(runs: Sequence[CalibrationRun], site: SiteConstants, metric: str = "steady") -> list[Row]:
    """Rows of the allocated level: measured ``steady`` (or ``peak_allocated``) against the estimate's
    persistent bytes (or peak allocated) as a function of the workspaces."""
    names = LEVEL_CONSTANTS["allocated"]
    attr = "persistent_bytes" if metric == "steady" else "peak_allocated_bytes"
    rows = []
    for run in runs:
        if run.device != "gpu":
            continue
        s = explicit(site, run.gpu)
        for o in run.observations:
            y = getattr(o, metric)
            if not y:
                continue
            base, a = _coefficients(run, o, s, names, attr)
            theta = [getattr(s, n) for n in names]
            rows.append(Row(run.name, float(y), base - sum(x * t for x, t in zip(a, theta)), tuple(a)))
    return rows


def reserved_rows(runs: Sequence[CalibrationRun]) -> list[Row]:
    """Rows of the reserved level: measured peak reserved = measured peak allocated x (1 + slack)."""
    return [Row(run.name, float(o.peak_reserved), float(o.peak_allocated), (float(o.peak_allocated),))
            for run in runs for o in run.observations if o.peak_reserved and o.peak_allocated]


def device_rows(runs: Sequence[CalibrationRun]) -> list[Row]:
    """Rows of the device level: measured device used = reserved then + CUDA context + communicators x NCCL buffers."""
    return [Row(run.name, float(o.device_used), float(o.reserved), (1.0, communicators(run.layout, _stage_has_moe(run, o))))
            for run in runs for o in run.observations if o.device_used and o.reserved]


def predicted(run: CalibrationRun, o: Observation, site: SiteConstants, metric: str) -> int:
    s = stage(run, o, site)
    return {"steady": s.persistent_bytes, "peak_allocated": s.peak_allocated_bytes, "peak_reserved": s.peak_reserved_bytes,
            "device_used": s.device_total_bytes}[metric]


def errors(run: CalibrationRun, site: SiteConstants, metric: str) -> list[float]:
    """Relative errors (predicted / measured - 1) of ``metric`` over the run's observations."""
    if metric == "device_used" and run.device != "gpu":
        return []
    out = []
    for o in run.observations:
        y = getattr(o, metric)
        if y:
            out.append(predicted(run, o, site, metric) / y - 1)
    return out


def with_values(site: SiteConstants, values: dict[str, float]) -> SiteConstants:
    """``site`` with fitted values, rounded as the profile file stores them (bytes as integers)."""
    clean = {k: (int(round(v)) if SPEC[k].unit == "bytes" else round(float(v), 5)) for k, v in values.items()}
    return replace(site, **clean)


__all__ = ["Observation", "CalibrationRun", "LEVEL_CONSTANTS", "LEVEL_METRIC", "METRICS", "METRIC_LABELS",
           "allocated_rows", "reserved_rows", "device_rows", "errors", "predicted", "explicit", "communicators",
           "with_values", "DEFAULT_SITE"]
