"""CPU shims for the end-to-end tests that run real megatron-core training on CPU.

The CPU referee's shims (benchmarks/referee/shims.py: devices, streams, RNG tracker, norms that
allocate what GPU kernels allocate, ...), plus torch's fused CPU Adam as the default optimizer
kernel: the referee configures that on the optimizer it builds, while here megatron's own
setup_model_and_optimizer (or the legacy stand-in's) builds it.
"""
from __future__ import annotations

import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.referee import shims as _referee  # noqa: E402

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _referee.install()
    # megatron-core falls back to torch.optim.Adam/AdamW without TE/apex; torch's fused CPU kernel
    # behaves like TE's FusedAdam (no per-tensor temporaries).
    for name in ("Adam", "AdamW"):
        base = getattr(torch.optim, name)
        fused_cls = type(name, (base,), {"__init__": lambda self, *a, _b=base, **k: _b.__init__(
            self, *a, **{**k, "fused": True, "foreach": False})})
        setattr(torch.optim, name, fused_cls)
