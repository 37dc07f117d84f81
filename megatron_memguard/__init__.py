"""megatron-memguard: per-rank GPU memory estimates for Megatron-LM / NeMo / Megatron-Bridge training.

    from megatron_memguard import estimate, layout_from_flags, lookup_gpu
    layout = layout_from_flags(["--num-layers", "32", ...], world_size=64)
    est = estimate(layout, gpu=lookup_gpu("H100-80GB"))
    print(est.verdict, est.critical.peak_allocated_bytes)

Importing this package loads neither torch nor megatron and patches nothing; the Megatron hook is
the separate ``import megatron_memguard.megatron``.
"""
from __future__ import annotations

from typing import Any, Mapping

from .config import RawConfig
from .errors import ConfigError, ConfigErrors, MemguardError, NotModelledError, ReaderError
from .estimator import Estimate, SiteConstants, StageEstimate, Term, estimate
from .gpus import GPUS, GpuSpec, lookup_gpu
from .layout import Layout
from .resolve import resolve

__version__ = "0.1.0.dev0"


def layout_from_flags(argv: list[str], world_size: int | None = None, megatron_version: str | None = None,
                      env: Mapping[str, str] | None = None) -> Layout:
    """Resolve Megatron command-line flags (as pretrain_gpt.py takes them) into a Layout."""
    from .readers.megatron_flags import parse_megatron_flags
    return resolve(parse_megatron_flags(argv, env=env), world_size=world_size, megatron_version=megatron_version)


def layout_from_megatron_args(namespace: Any, world_size: int | None = None,
                              megatron_version: str | None = None) -> Layout:
    """Resolve an ``argparse.Namespace`` as Megatron's ``parse_args``/``validate_args`` produce it."""
    from .readers.megatron_namespace import raw_from_namespace
    return resolve(raw_from_namespace(namespace), world_size=world_size, megatron_version=megatron_version)


__all__ = [
    "ConfigError", "ConfigErrors", "Estimate", "GPUS", "GpuSpec", "Layout", "MemguardError", "NotModelledError",
    "RawConfig", "ReaderError", "SiteConstants", "StageEstimate", "Term", "estimate", "layout_from_flags",
    "layout_from_megatron_args", "lookup_gpu", "resolve", "__version__",
]
