"""Site constants: the few physical numbers that differ between clusters, not between models.

The CUDA driver's context, NCCL's buffers on a given fabric, the cuBLAS and Transformer Engine
workspaces of a given PyTorch / TE build and the caching allocator's slack under a given workload
are properties of the site (hardware, driver, container), not of the training configuration.
``SiteConstants`` holds them; its defaults are the values memguard assumes everywhere else
(estimator/overheads.py, docs/terms/), so an estimate without a site profile is unchanged.
``memguard calibrate`` fits them from a site's own runs (docs/calibrate.md), each within the bounds
below; modelled terms (weights, gradients, optimizer states, activations) are never site constants.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..units import GiB, MiB, format_bytes
from .overheads import CUDA_CONTEXT_BYTES, FRAGMENTATION, NCCL_CHANNELS, NCCL_DEFAULT_BUFFSIZE


@dataclass(frozen=True)
class ConstantSpec:
    """What one site constant is, which estimate term it sets, at which level, and its physical bounds."""

    name: str
    term: str                 # the estimate term it sets (docs/terms/<term>.md)
    level: str                # allocated | reserved | device
    unit: str                 # bytes | ratio
    lower: float
    upper: float
    what: str

    def format(self, value: float | None) -> str:
        if value is None:
            return "by GPU"
        return format_bytes(value) if self.unit == "bytes" else f"{value:.1%}"


# Bounds are what is physically plausible, not what fits best: a fit that needs a value outside them
# is a modelling gap, and calibrate reports it as one.
SPECS: tuple[ConstantSpec, ...] = (
    ConstantSpec("cublas_workspace", "cublas_workspaces", "allocated", "bytes", 0, 256 * MiB,
                 "one cuBLAS / cuBLASLt handle's workspace when CUBLAS_WORKSPACE_CONFIG is unset (PyTorch's "
                 "default: 8.125 MiB before Hopper, 32 MiB on Hopper and newer); two handles per process"),
    ConstantSpec("te_workspace", "te_workspace", "allocated", "bytes", 0, 256 * MiB,
                 "Transformer Engine's GEMM workspace (TE's rule: 32 MiB + 1 KiB from compute capability 9, "
                 "4 MiB before)"),
    ConstantSpec("allocator_fragmentation", "allocator_fragmentation", "reserved", "ratio", 0.0, 1.0,
                 "caching-allocator slack: peak reserved / peak allocated - 1"),
    ConstantSpec("cuda_context", "cuda_context", "device", "bytes", 64 * MiB, 4 * GiB,
                 "CUDA context and loaded kernels per process (device memory outside PyTorch's allocator)"),
    ConstantSpec("nccl_per_communicator", "nccl_buffers", "device", "bytes", 0, 2 * GiB,
                 "NCCL's buffers per communicator in use (TP, PP, DP-CP, CP) at the default NCCL_BUFFSIZE "
                 "(4 MiB; a job's NCCL_BUFFSIZE scales it)"),
)
SPEC = {s.name: s for s in SPECS}


@dataclass(frozen=True)
class SiteConstants:
    """The site constants the estimator uses. ``None`` for a workspace: the rule by GPU generation."""

    cublas_workspace: int | None = None
    te_workspace: int | None = None
    allocator_fragmentation: float = FRAGMENTATION
    cuda_context: int = CUDA_CONTEXT_BYTES
    nccl_per_communicator: int = NCCL_CHANNELS * 2 * NCCL_DEFAULT_BUFFSIZE

    def __post_init__(self) -> None:
        for s in SPECS:
            v = getattr(self, s.name)
            if v is None and s.name in ("cublas_workspace", "te_workspace"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not s.lower <= v <= s.upper:
                raise ValueError(f"{s.name} must be within [{s.format(s.lower)}, {s.format(s.upper)}], got {v!r}")

    def __hash__(self) -> int:
        # a key of the per-stage caches (asked on every stage): hashed once, like Layout
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self)))
        return h

    def changed(self) -> dict[str, Any]:
        """The constants that differ from memguard's defaults."""
        base = DEFAULT_SITE
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}

    def describe(self) -> str:
        """One line naming the constants that differ from the defaults (empty when none do)."""
        return ", ".join(f"{k} {SPEC[k].format(v)} (default {SPEC[k].format(getattr(DEFAULT_SITE, k))})"
                         for k, v in self.changed().items())

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT_SITE = SiteConstants()
