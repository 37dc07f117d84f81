"""The resolved training layout (``Layout``) and its frozen parts; see layout/layout.py."""
from __future__ import annotations

from .chunk import Chunk
from .flat import FLAT, FLAT_NAMES
from .kernels import Kernels
from .layout import FLAT_REQUIRED, PARTS, Layout
from .moe import MoeSpec
from .parallelism import Parallelism, ShardGroup
from .precision import DTYPE_BYTES, Precision, TensorKind
from .provenance import Provenance
from .shape import ModelShape
from .training import Batch, Optimizer, PipelineSplit, Recompute

__all__ = ["DTYPE_BYTES", "FLAT", "FLAT_NAMES", "FLAT_REQUIRED", "PARTS", "Batch", "Chunk", "Kernels", "Layout", "ModelShape", "MoeSpec",
           "Optimizer", "Parallelism", "PipelineSplit", "Precision", "Provenance", "Recompute", "ShardGroup",
           "TensorKind"]
